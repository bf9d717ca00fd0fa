"""``evenly.from_parquet`` over real files: random access by row group, the manifest,
exactly-once with 2 workers and 2 ranks (simulated and real DDP), and ``evenly write``."""

from __future__ import annotations

import argparse
import gc
import os
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import evenly
import evenly.sources as es
from evenly.sources import _cli
from evenly.sources._parquet import ParquetSource
from tests.distributed import run_ranks
from tests.sources_helpers import as_list, check_exactly_once, epoch_over_ranks

N = 96


def make_samples(n: int = N) -> list[dict[str, Any]]:
    return [{"id": i, "payload": bytes([i % 251]) * 32, "label": i % 3} for i in range(n)]


@pytest.fixture
def parquet_dir(tmp_path: Path) -> str:
    out = tmp_path / "pq"
    es.write(make_samples(), out, rows_per_shard=20, row_group_size=7, progress=False)
    return str(out)


@pytest.fixture(autouse=True)
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("EVENLY_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_shards_sizes_and_random_access(parquet_dir: str) -> None:
    src = es.from_parquet(parquet_dir)
    assert len(src) == N
    assert src.shard_sizes == (20, 20, 20, 20, 16)
    assert src.preferred_shuffle == "global"
    assert src[37] == make_samples()[37]
    order = [95, 3, 40, 41, 0, 77, 3]
    assert [s["id"] for s in src.__getitems__(order)] == order
    assert src.locate(45) == os.path.join(parquet_dir, "shard-00002.parquet") + " row 5"
    with pytest.raises(IndexError, match=r"sample index 96 is out of range \[0, 96\)"):
        src[96]


def test_shuffle_true_is_global_for_local_parquet_whatever_the_cache(parquet_dir: str) -> None:
    default = es.from_parquet(parquet_dir)
    small = es.from_parquet(parquet_dir, row_group_cache_bytes=1024)  # far below the data
    assert default.preferred_shuffle == small.preferred_shuffle == "global"
    plans = [evenly.Dataset(s, shuffle=True, seed=5).plan() for s in (default, small)]
    assert all(isinstance(p.order, evenly.core.FeistelPermutation) for p in plans)  # no block
    assert plans[0].indices(np.arange(N)).tolist() == plans[1].indices(np.arange(N)).tolist()


class CountingParquet(ParquetSource):
    """A real ParquetSource that records each row-group lookup."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.chunks: list[tuple[int, int]] = []
        super().__init__(*args, **kwargs)

    def _chunk(self, k: int, g: int, handle: Any) -> pa.Table:
        self.chunks.append((k, g))
        return super()._chunk(k, g, handle)


def test_reads_row_groups_not_files(parquet_dir: str) -> None:
    src = CountingParquet(parquet_dir)
    # shard 1 rows 5..7 (row groups 0 and 1 of 7 rows each) and shard 3 row 0, mixed
    rows = src.__getitems__([27, 60, 25, 26, 61])
    assert [r["id"] for r in rows] == [27, 60, 25, 26, 61]
    assert src.chunks == [(1, 0), (1, 1), (3, 0)]  # one lookup per row group present
    assert sorted(src._groups) == [(1, 0), (1, 1), (3, 0)]
    assert sum(t.num_rows for t, _ in src._groups.values()) == 21


def test_row_group_cache_holds_arrow_tables_budgeted_by_their_memory(tmp_path: Path) -> None:
    out = tmp_path / "big"
    rows = [{"id": i, "text": f"sample number {i}", "x": i / 7} for i in range(6000)]
    es.write(rows, out, rows_per_shard=3000, row_group_size=500, progress=False)
    budget = 200_000  # the per-process LRU, with the node's decoded-row cache off
    src = es.from_parquet(str(out), row_group_cache_bytes=budget, decoded_cache_bytes=0)
    allocated = pa.total_allocated_bytes()
    for lo in range(0, 6000, 250):
        src.__getitems__(list(range(lo, lo + 250)))
        for key, (table, size) in src._groups.items():
            assert isinstance(table, pa.Table)  # Arrow data, not Python objects
            # and the per-row accessors (they read the text column's offsets in place)
            access = src._group_access[key]
            assert access is not None and access.nbytes == 0
            assert size == table.get_total_buffer_size() + access.nbytes
        assert src._group_bytes <= budget
    # the budget counts the memory the cache really holds, and more than one group fits
    held = sum(t.get_total_buffer_size() for t, _ in src._groups.values())
    held += sum(a.nbytes for a in src._group_access.values() if a is not None)
    assert held == src._group_bytes and len(src._groups) > 1
    assert set(src._group_access) == set(src._groups)  # evicted together
    # and nothing else holds Arrow memory: the accessors view the tables' buffers (the
    # pool rounds each buffer up to 64 bytes)
    src.close()
    gc.collect()
    buffers = sum(
        b is not None
        for t, _ in src._groups.values()
        for column in t.columns
        for chunk in column.chunks
        for b in chunk.buffers()
    )
    assert pa.total_allocated_bytes() - allocated <= src._group_bytes + 64 * buffers


@pytest.mark.parametrize("form", ["dir", "glob", "list", "url"])
def test_path_forms(parquet_dir: str, form: str) -> None:
    files = sorted(str(p) for p in Path(parquet_dir).glob("*.parquet"))
    paths: Any = {
        "dir": parquet_dir,
        "glob": os.path.join(parquet_dir, "shard-*.parquet"),
        "list": files,
        "url": "file://" + parquet_dir,
    }[form]
    src = es.from_parquet(paths)
    assert len(src) == N
    assert [s["id"] for s in src.__getitems__([0, 50, 95])] == [0, 50, 95]


def test_fingerprint_ignores_location(parquet_dir: str, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in Path(parquet_dir).glob("*.parquet"):
        (copy / f.name).write_bytes(f.read_bytes())
    a, b = es.from_parquet(parquet_dir), es.from_parquet(str(copy))
    assert a.fingerprint == b.fingerprint and a.fingerprint.startswith("parquet:96:")
    (copy / "shard-00004.parquet").unlink()
    assert es.from_parquet(str(copy)).fingerprint != a.fingerprint


def test_directory_skips_hidden_and_underscore_paths(parquet_dir: str) -> None:
    hidden = Path(parquet_dir) / ".cache" / "shards"
    hidden.mkdir(parents=True)
    (hidden / "copy.parquet").write_bytes((Path(parquet_dir) / "shard-00000.parquet").read_bytes())
    (Path(parquet_dir) / "_tmp.parquet").write_bytes(b"partial")
    assert len(es.from_parquet(parquet_dir)) == N


def test_columns(parquet_dir: str) -> None:
    src = es.from_parquet(parquet_dir, columns=["id"])
    assert src[5] == {"id": 5}
    with pytest.raises(ValueError, match=r"columns \['nope'\] not in the schema"):
        es.from_parquet(parquet_dir, columns=["nope"])


def _count_scans(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    scanned: list[str] = []
    real = ParquetSource._scan

    def counting(self: ParquetSource, k: int, url: str) -> tuple[int, dict[str, Any]]:
        scanned.append(url)
        return real(self, k, url)

    monkeypatch.setattr(ParquetSource, "_scan", counting)
    return scanned


def test_manifest_written_by_write_means_no_footer_read(
    parquet_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert os.path.exists(os.path.join(parquet_dir, ".evenly-manifest.json"))
    scanned = _count_scans(monkeypatch)
    assert len(es.from_parquet(parquet_dir)) == N
    assert scanned == []


def test_manifest_cache_rescans_only_changed_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = tmp_path / "plain"
    d.mkdir()
    for k in range(4):  # written by pyarrow: no manifest beside the data
        pq.write_table(pa.table({"id": list(range(k * 10, k * 10 + 10))}), d / f"p{k}.parquet")
    scanned = _count_scans(monkeypatch)
    assert len(es.from_parquet(str(d))) == 40
    assert len(scanned) == 4
    scanned.clear()
    assert len(es.from_parquet(str(d))) == 40
    assert scanned == []  # every entry came from the cache
    pq.write_table(pa.table({"id": list(range(100, 115))}), d / "p2.parquet")
    os.utime(d / "p2.parquet", (1, 1))  # a new fingerprint even within the mtime resolution
    src = es.from_parquet(str(d))
    assert scanned == [str(d / "p2.parquet")]
    assert len(src) == 45 and src[20]["id"] == 100


def test_pickle_drops_decoded_row_groups_and_no_file_stays_open(parquet_dir: str) -> None:
    src = es.from_parquet(parquet_dir, decoded_cache_bytes=0)  # row groups in the LRU
    src.__getitems__([1, 30])
    # a shard is opened to decode a row group and closed (an open ParquetFile keeps
    # a column chunk of heap)
    assert src._groups and not src._handles
    copy = pickle.loads(pickle.dumps(src))
    assert not copy._handles and not copy._groups and copy.entries is None
    assert copy[30] == src[30]


@pytest.mark.parametrize("shuffle", ["global", "block"])
def test_exactly_once_two_ranks_two_workers(parquet_dir: str, shuffle: str) -> None:
    src = es.from_parquet(parquet_dir)
    epochs = epoch_over_ranks(
        src, world_size=2, batch_size=4, num_workers=2, shuffle=shuffle, block_shards=2, epochs=2
    )
    for ranks in epochs:
        check_exactly_once(ranks, list(range(N)), key=lambda s: s["id"])
        assert all(len(b) == 4 for batches in ranks for b in batches)
    first = [s["id"] for b in epochs[0][0] for s in b]
    second = [s["id"] for b in epochs[1][0] for s in b]
    assert first != second  # a new order each epoch


def _ddp_epoch(rank: int, world_size: int, path: str) -> list[int]:
    ds = evenly.Dataset(es.from_parquet(path), shuffle=True, seed=3)
    loader = evenly.DataLoader(ds, batch_size=4, num_workers=2, collate_fn=as_list)
    return [s["id"] for batch in loader for s in batch]


@pytest.mark.slow
def test_real_ddp_two_ranks(parquet_dir: str, tmp_path: Path) -> None:
    env = {"EVENLY_CACHE_DIR": str(tmp_path / "ddp-cache")}
    ids = run_ranks(_ddp_epoch, 2, parquet_dir, env=env)
    assert len(ids[0]) == len(ids[1]) == N // 2
    assert sorted(ids[0] + ids[1]) == list(range(N))


def test_output_readable_without_evenly(parquet_dir: str) -> None:
    table = pq.read_table(parquet_dir)  # pyarrow skips the hidden manifest
    assert sorted(table.column("id").to_pylist()) == list(range(N))
    assert table.schema.field("payload").type == pa.binary()


def test_output_readable_by_hf_datasets(parquet_dir: str) -> None:
    datasets = pytest.importorskip("datasets")
    ds = datasets.load_dataset("parquet", data_dir=parquet_dir, split="train")
    assert sorted(ds["id"]) == list(range(N))


def test_write_map_style_tuples_and_tensors(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    data = [(torch.tensor([i, i + 1]), np.int64(i)) for i in range(10)]
    es.write(data, tmp_path / "t", rows_per_shard=4, progress=False)
    src = es.from_parquet(str(tmp_path / "t"))
    assert src.shard_sizes == (4, 4, 2)
    row = src[7]
    assert row["1"] == 7 and isinstance(row["0"], np.ndarray)  # a list of numbers: 1-D numpy
    assert row["0"].tolist() == [7, 8]


def test_write_rejects_bad_arguments_and_mixed_schemas(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="format must be one of"):
        es.write([{"a": 1}], tmp_path / "x", format="csv")
    with pytest.raises(ValueError, match="rows_per_shard must be an integer >= 1, got 0"):
        es.write([{"a": 1}], tmp_path / "x", rows_per_shard=0)
    rows = [{"a": 1}, {"a": 2}, {"a": "three"}]
    with pytest.raises(ValueError, match=r"sample 2: field 'a' holds str 'three'"):
        es.write(rows, tmp_path / "y", rows_per_shard=2, progress=False)


def test_cli_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "mydata.py").write_text(
        "def make():\n    return [{'id': i, 'text': str(i)} for i in range(25)]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    parser = argparse.ArgumentParser(prog="evenly")
    _cli.register(parser.add_subparsers(dest="command"))
    out = tmp_path / "cli-out"
    args = parser.parse_args(
        ["write", "mydata:make", str(out), "--format", "jsonl", "--rows-per-shard", "10"]
    )
    assert args.handler(args) == 0
    src = es.from_jsonl(str(out))
    assert src.shard_sizes == (10, 10, 5) and src[24] == {"id": 24, "text": "24"}
    bad = parser.parse_args(["write", "mydata:nothing", str(out)])
    assert bad.handler(bad) == 2


@pytest.mark.parametrize("cache", ["process", "node"])
def test_a_global_shuffle_beyond_the_row_group_cache_is_called_slow(
    parquet_dir: str, caplog: pytest.LogCaptureFixture, tmp_path: Path, cache: str
) -> None:
    settings = (
        {"row_group_cache_bytes": 1024, "decoded_cache_bytes": 0}
        if cache == "process"
        else {"decoded_cache_bytes": 1024, "cache_dir": str(tmp_path / "c")}
    )
    small = es.from_parquet(parquet_dir, **settings)
    with caplog.at_level("WARNING", logger="evenly"):
        evenly.Dataset(small, shuffle=True)
    assert "decodes a row group for almost every sample" in caplog.text
    assert ("decoded_cache_bytes" in caplog.text) == (cache == "node")
    caplog.clear()
    with caplog.at_level("WARNING", logger="evenly"):
        evenly.Dataset(small, shuffle="block")
        evenly.Dataset(es.from_parquet(parquet_dir), shuffle=True)
    assert "decodes a row group" not in caplog.text
