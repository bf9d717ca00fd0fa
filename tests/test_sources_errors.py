"""Bad input gives a clear error in the main process naming the file (and, once reading,
the sample index): missing, truncated or corrupt shards, schemas that differ, files that
are not what their extension says, unsafe tar member names."""

from __future__ import annotations

import gzip
import io
import json
import os
import re
import tarfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import evenly
import evenly.sources as es
from tests.sources_helpers import as_list

FORMATS = {"parquet": es.from_parquet, "webdataset": es.from_webdataset, "jsonl": es.from_jsonl}
EXT = {"parquet": ".parquet", "webdataset": ".tar", "jsonl": ".jsonl"}


@pytest.fixture(autouse=True)
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("EVENLY_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def written(tmp_path: Path, fmt: str, n: int = 32, per: int = 8) -> Path:
    out = tmp_path / fmt
    rows = [{"id": i, "txt": f"t{i}"} for i in range(n)]
    es.write(rows, out, format=fmt, rows_per_shard=per, progress=False)
    return out


def read_all(source: object, num_workers: int = 0) -> list[object]:
    """Read an epoch; with workers, the error must still reach the main process."""
    ds = evenly.Dataset(source, shuffle=True, rank=0, world_size=1)  # type: ignore[arg-type]
    loader = evenly.DataLoader(ds, batch_size=4, num_workers=num_workers, collate_fn=as_list)
    return [s for b in loader for s in b]


def sample_error(path: Path) -> str:
    """What the error must say: the file, the row in it, and the global sample index."""
    return rf"cannot read sample \d+ \({re.escape(str(path))} row \d+\)"


# ---- missing files ---------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
def test_missing_file_at_open(tmp_path: Path, fmt: str) -> None:
    d = written(tmp_path, fmt)
    files = sorted(str(p) for p in d.glob("*" + EXT[fmt]))
    gone = str(d / ("nope" + EXT[fmt]))
    with pytest.raises(FileNotFoundError, match=f"file not found: {re.escape(repr(gone))}"):
        FORMATS[fmt]([*files, gone])


@pytest.mark.parametrize("fmt", FORMATS)
def test_missing_file_while_reading(tmp_path: Path, fmt: str) -> None:
    d = written(tmp_path, fmt)
    source = FORMATS[fmt](str(d))
    victim = d / f"shard-00002{EXT[fmt]}"
    victim.unlink()
    # a pass starting after the loss says so at once, in the main process
    gone = rf"shard 2 \({re.escape(str(victim))}\) was deleted or moved since the source"
    with pytest.raises(FileNotFoundError, match=gone):
        read_all(source, num_workers=2 if fmt == "parquet" else 0)
    # a read of it names the sample, the file and the row
    with pytest.raises(FileNotFoundError, match=sample_error(victim)) as info:
        source.__getitems__(list(range(len(source))))  # type: ignore[attr-defined]
    assert "was it deleted or moved" in str(info.value)


def test_empty_directory(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"holds no file ending in \.parquet"):
        es.from_parquet(str(tmp_path))


# ---- truncated / corrupt ---------------------------------------------------------
@pytest.mark.parametrize("fmt", ["parquet", "webdataset"])
def test_truncated_shard_at_open(tmp_path: Path, fmt: str) -> None:
    d = written(tmp_path, fmt)
    victim = d / f"shard-00001{EXT[fmt]}"
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) * 2 // 3])
    match = rf"cannot read shard 1 \({re.escape(str(victim))}\): .*truncated"
    with pytest.raises(ValueError, match=match):
        FORMATS[fmt](str(d))


@pytest.mark.parametrize("fmt", FORMATS)
def test_shard_truncated_after_open(tmp_path: Path, fmt: str) -> None:
    d = written(tmp_path, fmt)
    source = FORMATS[fmt](str(d))
    victim = d / f"shard-00003{EXT[fmt]}"
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2])
    changed = rf"shard 3 \({re.escape(str(victim))}\) changed since the source was opened"
    with pytest.raises(ValueError, match=changed):
        read_all(source)
    with pytest.raises(ValueError, match=sample_error(victim)):
        source.__getitems__(list(range(len(source))))  # type: ignore[attr-defined]


def test_jsonl_bad_line_names_file_line_and_sample(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"id": 0}\n{"id": 1}\n{"id": 2, oops}\n{"id": 3}\n')
    source = es.from_jsonl(str(path))
    with pytest.raises(ValueError, match=rf"sample 2 \({re.escape(str(path))} row 2\).*line 3 "):
        source[2]
    with pytest.raises(ValueError, match=sample_error(path) + r".*line 3 is not valid JSON"):
        read_all(source)


# ---- schemas ---------------------------------------------------------------------
def test_parquet_schema_differs_between_shards(tmp_path: Path) -> None:
    pq.write_table(pa.table({"id": [1, 2], "x": [1.0, 2.0]}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"id": [3, 4], "x": ["a", "b"]}), tmp_path / "b.parquet")
    match = (
        rf"the schema of shard 1 \({re.escape(str(tmp_path / 'b.parquet'))}\) differs from "
        rf"shard 0 .*'x: double' vs 'x: string'"
    )
    with pytest.raises(ValueError, match=match):
        es.from_parquet(str(tmp_path))


def test_webdataset_fields_differ_between_shards(tmp_path: Path) -> None:
    es.write([{"__key__": "a", "jpg": b"1", "cls": b"0"}], tmp_path, "webdataset", prefix="x")
    es.write([{"__key__": "b", "png": b"1", "cls": b"0"}], tmp_path, "webdataset", prefix="y")
    with pytest.raises(ValueError, match=r"fields of shard 1 .*y-00000\.tar.*check_fields=False"):
        es.from_webdataset(str(tmp_path))
    assert len(es.from_webdataset(str(tmp_path), check_fields=False)) == 2


# ---- not what the extension says -------------------------------------------------
def test_text_named_parquet(tmp_path: Path) -> None:
    path = tmp_path / "data.parquet"
    path.write_text(json.dumps({"id": 1}) + "\n")
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}.*not a Parquet file"):
        es.from_parquet(str(path))


def test_parquet_named_tar(tmp_path: Path) -> None:
    path = tmp_path / "data.tar"
    pq.write_table(pa.table({"id": [1, 2, 3]}), path)
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}.*not a valid tar file"):
        es.from_webdataset(str(path))


def test_parquet_named_jsonl(tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    pq.write_table(pa.table({"id": [1, 2, 3]}), path)
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}.*binary file, not JSON Lines"):
        es.from_jsonl(str(path))


@pytest.mark.parametrize("fmt", ["webdataset", "jsonl"])
def test_gzip_named_uncompressed(tmp_path: Path, fmt: str) -> None:
    d = written(tmp_path, fmt, n=4, per=4)
    plain = d / f"shard-00000{EXT[fmt]}"
    plain.write_bytes(gzip.compress(plain.read_bytes()))
    with pytest.raises(ValueError, match=rf"{re.escape(str(plain))}.*(compressed tar|gzip)"):
        FORMATS[fmt](str(plain))


# ---- unsafe tar members ----------------------------------------------------------
@pytest.mark.parametrize("name", ["../escape.txt", "a/../../b.txt", "/etc/passwd.txt"])
def test_tar_member_names_with_dotdot_or_absolute_are_rejected(tmp_path: Path, name: str) -> None:
    path = tmp_path / "evil.tar"
    with tarfile.open(path, "w") as tar:
        for member in ("ok.txt", name):
            info = tarfile.TarInfo(member)
            info.size = 1
            tar.addfile(info, io.BytesIO(b"x"))
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}.*unsafe member name"):
        es.from_webdataset(str(path))
    assert not os.path.exists(tmp_path.parent / "escape.txt")


def test_write_rejects_unsafe_keys(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unsafe member name"):
        es.write([{"__key__": "../x", "txt": "a"}], tmp_path, "webdataset", progress=False)


def test_bad_jsonl_line_in_a_batch_names_its_own_sample(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_text("".join(f'{{"id": {i}}}\n' for i in range(4)))
    bad = tmp_path / "b.jsonl"
    bad.write_text('{"id": 4}\n{"id": 5}\n\n{"id": 6, oops}\n{"id": 7}\n')
    source = es.from_jsonl(str(tmp_path))
    # samples 5, 6, 7 of the batch live in b.jsonl; 6 (row 2, line 4) is the bad one
    match = rf"cannot read sample 6 \({re.escape(str(bad))} row 2\): line 4 is not valid JSON"
    with pytest.raises(ValueError, match=match):
        source.__getitems__([0, 5, 7, 6])
    # through the loader (batches [0..3], [4..7]), with a worker: the same sample named
    ds = evenly.Dataset(source, shuffle=False, rank=0, world_size=1)
    loader = evenly.DataLoader(ds, batch_size=4, num_workers=1, collate_fn=as_list)
    with pytest.raises(ValueError, match=match):
        list(loader)


def test_bad_tar_member_in_a_batch_names_its_own_sample(tmp_path: Path) -> None:
    path = tmp_path / "a.tar"
    with tarfile.open(path, "w") as tar:
        for i in range(4):
            info = tarfile.TarInfo(f"k{i}.txt")
            info.size = 1
            tar.addfile(info, io.BytesIO(b"x"))
    source = es.from_webdataset(str(path))
    data = bytearray(path.read_bytes())
    data[2 * 1024 : 2 * 1024 + 8] = b"garbage!"  # the header of k2.txt
    path.write_bytes(bytes(data))
    match = rf"cannot read sample 2 \({re.escape(str(path))} row 2\): the file changed"
    with pytest.raises(ValueError, match=match):
        source.__getitems__([0, 1, 2, 3])
