"""``evenly.write`` to Parquet and Arrow never drops or nulls a field a sample has: the
schema is the union of the samples' fields, or the write raises naming the sample."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import evenly.sources as es

TABLES = ["parquet", "arrow"]


@pytest.fixture(autouse=True)
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("EVENLY_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def read_back(fmt: str, path: Path) -> list[dict[str, object]]:
    """The rows as pyarrow itself reads the files (no evenly on the read side)."""
    files = sorted(path.glob(f"*.{fmt}"))
    if fmt == "parquet":
        return [r for f in files for r in pq.read_table(f).to_pylist()]
    return [
        r for f in files for r in pa.ipc.open_file(pa.memory_map(str(f))).read_all().to_pylist()
    ]


@pytest.mark.parametrize("fmt", TABLES)
def test_fields_of_later_rows_are_kept_in_a_shard(tmp_path: Path, fmt: str) -> None:
    rows = [{"a": 3}, {"a": 4, "b": "extra"}, {"b": "only b", "c": 2.5}]
    es.write(rows, tmp_path / fmt, format=fmt, progress=False)
    assert read_back(fmt, tmp_path / fmt) == [
        {"a": 3, "b": None, "c": None},
        {"a": 4, "b": "extra", "c": None},
        {"a": None, "b": "only b", "c": 2.5},
    ]


@pytest.mark.parametrize("fmt", TABLES)
def test_types_are_inferred_from_every_row_of_a_shard(tmp_path: Path, fmt: str) -> None:
    rows = [{"x": 1}, {"x": 2, "y": 1}, {"y": 2.5}]  # y is first seen in row 1
    es.write(rows, tmp_path / fmt, format=fmt, progress=False)
    assert read_back(fmt, tmp_path / fmt) == [
        {"x": 1, "y": None},
        {"x": 2, "y": 1.0},
        {"x": None, "y": 2.5},
    ]


@pytest.mark.parametrize("fmt", TABLES)
def test_a_value_of_another_type_raises_naming_the_sample(tmp_path: Path, fmt: str) -> None:
    rows = [{"a": 1}, {"a": 2}, {"a": 3}, {"a": "three"}]
    with pytest.raises(ValueError, match=r"sample 3: field 'a' holds str 'three'.*int64"):
        es.write(rows, tmp_path / fmt, format=fmt, rows_per_shard=2, progress=False)


@pytest.mark.parametrize("fmt", TABLES)
def test_a_new_field_in_a_later_shard_raises_naming_the_sample(tmp_path: Path, fmt: str) -> None:
    rows = [{"a": 1}, {"a": 2}, {"a": 3, "b": "late"}]
    with pytest.raises(
        ValueError, match=r"sample 2 has a field 'b' that shard 0 \(samples 0\.\.1\) lacks"
    ):
        es.write(rows, tmp_path / fmt, format=fmt, rows_per_shard=2, progress=False)


@pytest.mark.parametrize("fmt", TABLES)
def test_a_struct_key_is_never_dropped(tmp_path: Path, fmt: str) -> None:
    rows = [{"m": {"x": 1}}, {"m": {"x": 2}}, {"m": {"x": 3, "z": 9}}]
    with pytest.raises(ValueError, match=r"sample 2: key 'm\.z' is not in the type"):
        es.write(rows, tmp_path / fmt, format=fmt, rows_per_shard=2, progress=False)
    es.write(rows, tmp_path / "one", format=fmt, progress=False)  # one shard: keys united
    assert read_back(fmt, tmp_path / "one")[2] == {"m": {"x": 3, "z": 9}}


@pytest.mark.parametrize("fmt", TABLES)
def test_schema_argument_types_every_shard(tmp_path: Path, fmt: str) -> None:
    rows = [{"id": i, "note": None if i < 2 else f"n{i}"} for i in range(4)]
    with pytest.raises(ValueError, match=r"sample 2: field 'note'.*null in every sample"):
        es.write(rows, tmp_path / "bad", format=fmt, rows_per_shard=2, progress=False)
    schema = pa.schema([("id", pa.int32()), ("note", pa.string())])
    es.write(rows, tmp_path / fmt, format=fmt, rows_per_shard=2, schema=schema, progress=False)
    assert read_back(fmt, tmp_path / fmt) == [
        {"id": 0, "note": None},
        {"id": 1, "note": None},
        {"id": 2, "note": "n2"},
        {"id": 3, "note": "n3"},
    ]


def test_schema_is_only_for_table_formats(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="schema= applies to 'parquet' and 'arrow'"):
        es.write([{"a": 1}], tmp_path, format="jsonl", schema=pa.schema([("a", pa.int64())]))


def test_arrow_output_is_ipc_files_with_a_manifest(tmp_path: Path) -> None:
    rows = [{"id": i, "v": np.arange(3, dtype=np.float32) + i} for i in range(10)]
    paths = es.write(
        rows, tmp_path, format="arrow", rows_per_shard=4, row_group_size=3, progress=False
    )
    assert [Path(p).name for p in paths] == [f"shard-0000{k}.arrow" for k in range(3)]
    assert (tmp_path / ".evenly-manifest.json").exists()
    reader = pa.ipc.open_file(pa.memory_map(paths[0]))
    assert reader.num_record_batches == 2  # row_group_size rows per record batch
    assert reader.read_all().column("v").to_pylist()[1] == [1.0, 2.0, 3.0]
    src = es.from_arrow(str(tmp_path))
    assert src.shard_sizes == (4, 4, 2) and src[9]["id"] == 9
