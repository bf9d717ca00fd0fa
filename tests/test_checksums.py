"""Bytes that changed on disk are never served as data: Parquet page checksums are
verified on every read path of ``evenly.from_parquet`` (``evenly.write`` writes them), and
each entry of the decoded-row cache carries a checksum checked when it is mapped (a bad
entry is decoded again, with one ``EvenlyWarning``)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import evenly
import evenly.sources as es
from evenly.errors import EvenlyWarning
from tests.sources_helpers import as_list

ROWS, GROUP, BAD = 400, 100, 250  # row 250 (row group 2) gets a flipped bit
BATCH = 10


def flip_plain_value(path: Path, row: int, width: int = 8) -> None:
    """Flip one bit of the value ``row`` in a PLAIN-encoded integer column of ``width``
    bytes (found by its bytes: that value and the next one, side by side in the page)."""
    data = bytearray(path.read_bytes())
    at = data.find(row.to_bytes(width, "little") + (row + 1).to_bytes(width, "little"))
    assert at > 0
    data[at] ^= 0x04
    path.write_bytes(bytes(data))


def write_plain(path: Path, *, checksums: bool, tokens: bool = False) -> None:
    """A file whose columns are PLAIN-encoded and uncompressed (the values are on disk as
    they are), row groups of ``GROUP`` rows; ``tokens``: a list<int32> column of
    ``[i, i + 1]`` instead of the string column."""
    ids = pa.array(np.arange(ROWS, dtype=np.int64))
    other = (
        pa.array([[i, i + 1] for i in range(ROWS)], pa.list_(pa.int32()))
        if tokens
        else pa.array([f"t{i}" for i in range(ROWS)])
    )
    table = pa.table({"id": ids, "tokens" if tokens else "tag": other})
    pq.write_table(
        table,
        path,
        row_group_size=GROUP,
        use_dictionary=False,
        compression="none",
        write_page_checksum=checksums,
    )


@pytest.fixture
def corrupt_dir(tmp_path: Path) -> Path:
    data = tmp_path / "data"
    data.mkdir()
    write_plain(data / "a.parquet", checksums=True)
    flip_plain_value(data / "a.parquet", BAD)
    return data


def _iterate(src: Any, *, workers: int, columns: bool) -> list[int]:
    ds = evenly.Dataset(src, shuffle=False, rank=0, world_size=1)
    loader = evenly.DataLoader(
        ds,
        batch_size=BATCH,
        num_workers=workers,
        collate_fn=None if columns else as_list,
        timeout=60 if workers else 0,
    )
    ids: list[int] = []
    for batch in loader:
        ids.extend(batch["id"].tolist() if columns else [s["id"] for s in batch])
    return ids


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("cache", ["row-cache", "no-row-cache"])
@pytest.mark.parametrize("path", ["rows", "columns"])
def test_a_flipped_bit_in_a_checksummed_page_is_an_error_naming_file_row_group_and_sample(
    corrupt_dir: Path, tmp_path: Path, workers: int, cache: str, path: str
) -> None:
    """Served as the value 254 (never written) before: now every read path (direct
    row-group reads, the decoded-row cache's build, columnar and row batches) raises in
    the main process, naming the file, the row group and the sample."""
    src = es.from_parquet(
        corrupt_dir,
        cache_dir=str(tmp_path / "c"),
        decoded_cache_bytes=None if cache == "row-cache" else 0,
    )
    assert (src.decoded_cache is not None) == (cache == "row-cache")
    with pytest.raises(ValueError) as info:
        _iterate(src, workers=workers, columns=path == "columns")
    message = str(info.value)
    assert "fails its page checksum" in message, message
    assert "row group 2 of " + str(corrupt_dir / "a.parquet") in message
    # the batch [200, 210) is the first to touch row group 2
    assert "cannot read sample 200 " in message
    if cache == "row-cache":  # nothing damaged went into the cache
        rows_dir = tmp_path / "c" / "rows"
        assert len([n for n in os.listdir(rows_dir) if n.endswith(".arrow")]) == 2


@pytest.mark.parametrize("bound", [None, 0], ids=["row-cache", "no-row-cache"])
def test_single_reads_and_packings_lengths_pass_verify_too(
    corrupt_dir: Path, tmp_path: Path, bound: int | None
) -> None:
    src = es.from_parquet(corrupt_dir, cache_dir=str(tmp_path / "c"), decoded_cache_bytes=bound)
    assert src[199]["id"] == 199  # row group 1 is intact
    with pytest.raises(ValueError, match=r"cannot read sample 251 .*row group 2 .*checksum"):
        src[251]
    with pytest.raises(ValueError, match=r"sample 251 .*row group 2 .*fails its page checksum"):
        src.read_columns([5, 251])
    # packing's lengths pass reads only the token column's offsets, straight from the file
    tokens = tmp_path / "tokens"
    tokens.mkdir()
    write_plain(tokens / "a.parquet", checksums=True, tokens=True)
    flip_plain_value(tokens / "a.parquet", BAD, width=4)
    src = es.from_parquet(tokens, cache_dir=str(tmp_path / "c"), decoded_cache_bytes=bound)
    with pytest.raises(ValueError, match=r"row group 2 .*fails its page checksum"):
        src.token_lengths("tokens")


def test_evenly_write_and_its_cli_write_page_checksums(tmp_path: Path) -> None:
    """A byte changed inside a data page of a shard written by ``evenly write`` (Python and
    command line) is an error naming the checksum; a file written without checksums (by
    another tool) stays readable, unverified."""
    rows = [{"id": i, "text": f"document {i} " * 8} for i in range(300)]
    es.write(rows, tmp_path / "py", rows_per_shard=300, row_group_size=100, progress=False)
    jsonl = tmp_path / "in.jsonl"
    jsonl.write_text("".join(f'{{"id": {r["id"]}, "text": "{r["text"]}"}}\n' for r in rows))
    from evenly.cli import main

    cli = ["write", str(jsonl), str(tmp_path / "cli"), "--row-group-size", "100", "--no-progress"]
    assert main(cli) == 0
    for out in ("py", "cli"):
        shard = tmp_path / out / "shard-00000.parquet"
        column = pq.ParquetFile(shard).metadata.row_group(1).column(1)  # "text", group 1
        start = column.dictionary_page_offset if column.has_dictionary_page else None
        end = (start or column.data_page_offset) + column.total_compressed_size
        data = bytearray(shard.read_bytes())
        data[end - 3] ^= 0x10  # inside the last page's payload
        shard.write_bytes(bytes(data))
        src = es.from_parquet(tmp_path / out, cache_dir=str(tmp_path / "c"))
        assert src[5]["id"] == 5  # row group 0 is intact
        with pytest.raises(ValueError, match=r"sample 150 .*row group 1 .*page checksum"):
            src[150]
    plain = tmp_path / "plain"
    plain.mkdir()
    write_plain(plain / "a.parquet", checksums=False)
    src = es.from_parquet(plain, cache_dir=str(tmp_path / "c"))
    assert [s["id"] for s in src.__getitems__(list(range(ROWS)))] == list(range(ROWS))


# ---- the decoded-row cache: an entry whose bytes changed on disk --------------------------
def payload(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest() * 4  # 128 bytes, one per id


CACHED_ROWS, CACHED_GROUP, VICTIM = 200, 50, 120  # row 120 is in row group 2


def cached_data(tmp_path: Path) -> tuple[Path, Path]:
    """Shards written by ``evenly.write``, and a cache holding every row group, one of
    them with a flipped byte inside row ``VICTIM``'s payload."""
    data, cache = tmp_path / "data", tmp_path / "cache"
    rows = [{"id": i, "payload": payload(i)} for i in range(CACHED_ROWS)]
    es.write(rows, data, rows_per_shard=CACHED_ROWS, row_group_size=CACHED_GROUP, progress=False)
    src = es.from_parquet(data, cache_dir=str(cache))
    assert [r["id"] for r in src.__getitems__(list(range(CACHED_ROWS)))] == list(range(200))
    flipped = 0
    for name in os.listdir(cache / "rows"):
        if name.endswith(".arrow"):
            entry = bytearray((cache / "rows" / name).read_bytes())
            at = entry.find(payload(VICTIM))
            if at >= 0:
                entry[at + 5] ^= 0x20
                (cache / "rows" / name).write_bytes(bytes(entry))
                flipped += 1
    assert flipped == 1
    return data, cache


def check_payloads(rows: list[dict[str, Any]]) -> None:
    bad = [r["id"] for r in rows if r["payload"] != payload(r["id"])]
    assert not bad, f"rows served with bytes never written: {bad}"


def test_a_flipped_byte_in_a_cached_entry_is_decoded_again_with_one_warning(
    tmp_path: Path,
) -> None:
    """0 workers: served as data before (row 120's payload changed); now the entry fails
    its checksum when it is mapped, is removed and decoded again: the right rows, one
    ``EvenlyWarning`` naming the entry and the source."""
    data, cache = cached_data(tmp_path)
    src = es.from_parquet(data, cache_dir=str(cache))
    ds = evenly.Dataset(src, shuffle=True, seed=1, rank=0, world_size=1)
    loader = evenly.DataLoader(ds, batch_size=BATCH, collate_fn=as_list)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rows = [r for batch in loader for r in batch]
    assert sorted(r["id"] for r in rows) == list(range(CACHED_ROWS))
    check_payloads(rows)
    said = [str(w.message) for w in caught if issubclass(w.category, EvenlyWarning)]
    assert len(said) == 1, said
    assert "decoded-row cache entry" in said[0] and "is damaged" in said[0]
    assert f"row group 2 of {data / 'shard-00000.parquet'}" in said[0]
    assert src.decoded_cache is not None and src.decoded_cache.decodes == 1
    check_payloads(es.from_parquet(data, cache_dir=str(cache)).__getitems__([VICTIM]))


_TWO_WORKERS = """
import json, sys
import evenly, evenly.sources as es
from tests.test_checksums import as_list, payload

data, cache = sys.argv[1], sys.argv[2]
ds = evenly.Dataset(es.from_parquet(data, cache_dir=cache), shuffle=True, seed=1)
loader = evenly.DataLoader(ds, batch_size=8, num_workers=2, collate_fn=as_list, timeout=60)
rows = [r for batch in loader for r in batch]
bad = [r["id"] for r in rows if r["payload"] != payload(r["id"])]
print(json.dumps({"ids": sorted(r["id"] for r in rows), "bad": bad}))
"""


def test_two_workers_rebuild_a_damaged_entry_once_and_serve_the_right_rows(
    tmp_path: Path,
) -> None:
    """2 workers (in a fresh interpreter, so the workers' warnings reach its stderr under
    Python's default filters): the right rows, the warning printed once (one worker
    removes the entry under its lock; the other maps the new one)."""
    data, cache = cached_data(tmp_path)
    run = subprocess.run(
        [sys.executable, "-c", _TWO_WORKERS, str(data), str(cache)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONWARNINGS": "default"},
        cwd=Path(__file__).resolve().parents[1],
    )
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["ids"] == list(range(CACHED_ROWS))
    assert out["bad"] == [], f"rows served with bytes never written: {out['bad']}"
    assert run.stderr.count("EvenlyWarning") == 1, run.stderr
    assert "is damaged" in run.stderr
