"""Dict rows built from per-row accessors of cached chunks equal the rows an
Arrow ``take`` gives, value for value and type for type; chunks the accessors cannot
read (nulls, nested types) go the general way; tar batches located in one go equal the
samples read one by one."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import evenly
from evenly.sources._columns import to_rows
from evenly.sources._rowviews import RowAccess

N = 240


def table(with_nulls: bool = False, nested: bool = False) -> pa.Table:
    rng = np.random.default_rng(0)
    cols: dict[str, Any] = {
        "i8": pa.array(rng.integers(-100, 100, N), pa.int8()),
        "u32": pa.array(rng.integers(0, 1 << 31, N), pa.uint32()),
        "i64": pa.array(np.arange(N) * (1 << 40), pa.int64()),
        "f16": pa.array(rng.random(N).astype(np.float16), pa.float16()),
        "f64": pa.array(rng.random(N), pa.float64()),
        "flag": pa.array(rng.random(N) > 0.5, pa.bool_()),
        "text": pa.array([f"sample {i} é" * (i % 4) for i in range(N)], pa.string()),
        "big_text": pa.array([str(i) for i in range(N)], pa.large_string()),
        "raw": pa.array([bytes([i % 256]) * (i % 7) for i in range(N)], pa.binary()),
        "big_raw": pa.array([b"x" * (i % 3) for i in range(N)], pa.large_binary()),
    }
    if with_nulls:
        cols["maybe"] = pa.array([None if i % 5 == 0 else i for i in range(N)], pa.int32())
    if nested:
        cols["seq"] = pa.array([[i, i + 1] for i in range(N)], pa.list_(pa.int64()))
    return pa.table(cols)


def assert_rows_equal(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert list(g) == list(w)
        for k in g:
            if isinstance(w[k], np.ndarray):
                assert np.array_equal(g[k], w[k])
            else:
                assert type(g[k]) is type(w[k]) and g[k] == w[k], k


@pytest.mark.parametrize("fmt", ["parquet", "arrow"])
@pytest.mark.parametrize("kind", ["plain", "nulls", "nested"])
def test_batch_rows_equal_arrow_take_rows(tmp_path: Path, fmt: str, kind: str) -> None:
    t = table(with_nulls=kind == "nulls", nested=kind == "nested")
    for k in range(3):  # three shards, chunks of 37 rows (a chunk may start mid-buffer)
        part = t.slice(k * 80, 80)
        if fmt == "parquet":
            pq.write_table(part, tmp_path / f"s{k}.parquet", row_group_size=37)
        else:
            with pa.ipc.new_file(tmp_path / f"s{k}.arrow", part.schema) as w:
                for b in part.to_batches(max_chunksize=37):
                    w.write_batch(b)
    src = evenly.from_parquet(tmp_path) if fmt == "parquet" else evenly.from_arrow(tmp_path)
    order = np.random.default_rng(1).permutation(N).tolist()
    for lo in range(0, N, 50):
        batch = order[lo : lo + 50]
        assert_rows_equal(src.__getitems__(batch), to_rows(t.take(pa.array(batch))))
    fast = RowAccess.of(t.slice(0, 10).combine_chunks())
    assert (fast is None) == (kind != "plain")  # nulls and nested types: Arrow's way


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 1 << 62), st.binary(max_size=8)), max_size=30))
def test_accessor_rows_equal_to_pylist(values: list[tuple[int, bytes]]) -> None:
    t = pa.table(
        {
            "n": pa.array([v for v, _ in values], pa.int64()),
            "b": pa.array([b for _, b in values], pa.binary()),
        }
    )
    for start in (0, len(values) // 2):
        part = t.slice(start)
        access = RowAccess.of(part)
        assert access is not None
        assert [access.row(i) for i in range(part.num_rows)] == part.to_pylist()


def write_tar(path: Path, samples: list[tuple[str, dict[str, bytes]]]) -> None:
    with tarfile.open(path, "w") as tar:
        for key, fields in samples:
            for ext, data in fields.items():
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


def test_tar_batches_read_across_shards_with_fields_in_another_order(tmp_path: Path) -> None:
    write_tar(
        tmp_path / "a.tar", [(f"a{i}", {"txt": b"A%d" % i, "cls": b"%d" % i}) for i in range(5)]
    )
    write_tar(
        tmp_path / "b.tar", [(f"b{i}", {"cls": b"%d" % i, "txt": b"B%d" % i}) for i in range(4)]
    )
    src = evenly.from_webdataset(tmp_path)
    singles = [src[i] for i in range(9)]
    assert [s["txt"] for s in singles] == [
        b"A0",
        b"A1",
        b"A2",
        b"A3",
        b"A4",
        b"B0",
        b"B1",
        b"B2",
        b"B3",
    ]
    batch = [8, 0, 5, 3, 8, 1]
    assert src.__getitems__(batch) == [singles[i] for i in batch]


@pytest.mark.parametrize("fmt", ["parquet", "arrow-window", "arrow-per-batch"])
def test_columns_gathered_from_cached_chunks_equal_default_collate(
    tmp_path: Path, fmt: str
) -> None:
    """Fixed-width columns are gathered with one fancy index: over the row groups in use
    (Parquet, with a cache that evicts some mid-batch), over every record batch of every
    file (local Arrow files that all fit among the open files), or over the record
    batches in use (more Arrow files than may be open: some closed mid-batch)."""
    import torch
    import torch.utils.data as tud

    schema = pa.schema([("i", pa.int32()), ("f", pa.float32()), ("v", pa.list_(pa.uint8(), 5))])
    rows = [{"i": i, "f": i / 3, "v": np.full(5, i % 256, dtype=np.uint8)} for i in range(130)]
    kind = "parquet" if fmt == "parquet" else "arrow"
    evenly.write(
        iter(rows),
        tmp_path / "d",
        format=kind,
        rows_per_shard=50,
        schema=schema,
        row_group_size=16,
        progress=False,
    )
    if fmt == "parquet":  # a cache too small for all row groups: some are evicted mid-batch
        src: Any = evenly.from_parquet(
            tmp_path / "d", row_group_cache_bytes=2000, decoded_cache_bytes=0
        )
    else:
        src = evenly.from_arrow(tmp_path / "d")
        if fmt == "arrow-per-batch":
            src.max_open_files = 1
    assert src._gather(np.array([0, 1])) is not None  # the numpy path is the one under test
    assert ("_window" in vars(src)) == (fmt == "arrow-window")
    for batch in ([129, 0, 64, 64, 3, 17, 100], np.random.default_rng(2).permutation(130)):
        got = src.read_columns(batch)
        want = tud.default_collate([src[int(i)] for i in batch])
        for name in ("i", "f", "v"):
            tensor = torch.from_numpy(got[name])
            assert tensor.dtype == want[name].dtype and torch.equal(tensor, want[name]), name
