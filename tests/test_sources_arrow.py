"""``evenly.from_arrow`` over real Arrow IPC files and HF ``datasets`` on disk, and the
columnar contract of the Arrow-backed sources (Arrow, Parquet): ``read_columns`` equals
``default_collate`` of the rows."""

from __future__ import annotations

import json
import os
import pickle
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data import default_collate

import evenly
import evenly.sources as es
from evenly.sources._gather import gatherable

N = 61
SCHEMA = pa.schema(
    [
        ("id", pa.int64()),
        ("i32", pa.int32()),
        ("f32", pa.float32()),
        ("f64", pa.float64()),
        ("flag", pa.bool_()),
        ("text", pa.string()),
        ("pixels", pa.list_(pa.uint8(), 4)),
    ]
)


def rows(n: int = N) -> list[dict[str, Any]]:
    return [
        {
            "id": i,
            "i32": -i,
            "f32": i / 3,
            "f64": i / 7,
            "flag": i % 3 == 0,
            "text": f"row {i}",
            "pixels": np.arange(4, dtype=np.uint8) + i,
        }
        for i in range(n)
    ]


@pytest.fixture(autouse=True)
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("EVENLY_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    base = tmp_path_factory.mktemp("columnar")
    out = {}
    for fmt, reader in (("arrow", es.from_arrow), ("parquet", es.from_parquet)):
        es.write(
            rows(),
            base / fmt,
            format=fmt,
            rows_per_shard=16,
            row_group_size=5,
            schema=SCHEMA,
            progress=False,
        )
        out[fmt] = reader(str(base / fmt), cache_dir=str(base / "cache"))
        # numbers only: gathered with numpy, not through Arrow take
        numeric = ["id", "i32", "f32", "f64", "pixels"]
        out[fmt + "-numeric"] = reader(str(base / fmt), cache_dir=str(base / "c"), columns=numeric)
    return out


@pytest.fixture
def arrow_dir(tmp_path: Path) -> str:
    es.write(
        rows(),
        tmp_path / "arrow",
        format="arrow",
        rows_per_shard=16,
        row_group_size=5,
        progress=False,
    )
    return str(tmp_path / "arrow")


def write_ipc(path: Path, table: pa.Table, *, stream: bool, chunk: int = 4) -> None:
    with pa.OSFile(str(path), "wb") as sink:
        opener = pa.ipc.new_stream if stream else pa.ipc.new_file
        with opener(sink, table.schema) as w:
            w.write_table(table, max_chunksize=chunk)


# ---- the Arrow source on its own -----------------------------------------------------


def test_reads_ipc_file_and_stream_formats(tmp_path: Path) -> None:
    write_ipc(tmp_path / "a.arrow", pa.table({"id": list(range(10))}), stream=False)
    write_ipc(tmp_path / "b.arrow", pa.table({"id": list(range(10, 17))}), stream=True)
    src = es.from_arrow(str(tmp_path))
    assert len(src) == 17 and src.shard_sizes == (10, 7)
    assert src.preferred_shuffle == "global"
    assert [r["id"] for r in src.__getitems__([16, 0, 9, 10, 3])] == [16, 0, 9, 10, 3]
    assert src.locate(12) == str(tmp_path / "b.arrow") + " row 2"
    with pytest.raises(IndexError, match=r"sample index 17 is out of range \[0, 17\)"):
        src[17]


def test_rows_and_columns_selection(arrow_dir: str) -> None:
    src = es.from_arrow(arrow_dir, columns=["id", "text"])
    assert src[33] == {"id": 33, "text": "row 33"}
    with pytest.raises(ValueError, match=r"columns \['nope'\] not in the schema"):
        es.from_arrow(arrow_dir, columns=["nope"])


def test_fingerprint_ignores_location(arrow_dir: str, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in Path(arrow_dir).glob("*.arrow"):
        (copy / f.name).write_bytes(f.read_bytes())
    a, b = es.from_arrow(arrow_dir), es.from_arrow(str(copy))
    assert a.fingerprint == b.fingerprint and a.fingerprint.startswith("arrow:61:")


def test_pickle_drops_open_maps(arrow_dir: str) -> None:
    src = es.from_arrow(arrow_dir)
    src.__getitems__([1, 40])
    assert src._handles
    copy = pickle.loads(pickle.dumps(src))
    assert not copy._handles and copy[40]["id"] == 40


def test_a_file_that_is_not_arrow_raises_naming_it(tmp_path: Path) -> None:
    (tmp_path / "bad.arrow").write_bytes(b"not arrow at all" * 10)
    with pytest.raises(ValueError, match=r"cannot read shard 0 .*bad\.arrow.*not a readable"):
        es.from_arrow(str(tmp_path))


# ---- the columnar contract -----------------------------------------------------------


@pytest.mark.parametrize("fmt", ["arrow", "parquet", "arrow-numeric", "parquet-numeric"])
@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(batch=st.lists(st.integers(0, N - 1), min_size=1, max_size=24))
def test_read_columns_equals_default_collate(
    sources: dict[str, Any], fmt: str, batch: list[int]
) -> None:
    src = sources[fmt]
    assert src.columnar_exact
    gathered = src._gather(np.asarray(batch)) if gatherable(src.schema) else None
    assert (gathered is not None) == fmt.endswith("numeric")  # which path is under test
    columns = src.read_columns(batch)
    expected = default_collate([src[i] for i in batch])
    assert list(columns) == list(expected)
    for name, value in columns.items():
        if isinstance(value, np.ndarray):
            got = torch.from_numpy(value)
            assert got.dtype == expected[name].dtype, name
            assert torch.equal(got, expected[name]), name
        else:
            assert value == expected[name], name
    assert columns["pixels"].shape == (len(batch), 4)
    assert columns["id"].tolist() == batch


@pytest.mark.parametrize("fmt", ["arrow", "parquet"])
def test_row_values_are_python_scalars_and_numpy_lists(sources: dict[str, Any], fmt: str) -> None:
    row = sources[fmt][7]
    assert type(row["id"]) is int and type(row["f32"]) is float and type(row["flag"]) is bool
    assert isinstance(row["pixels"], np.ndarray) and row["pixels"].dtype == np.uint8
    assert row["pixels"].tolist() == [7, 8, 9, 10] and row["text"] == "row 7"


@pytest.mark.parametrize("fmt", ["arrow", "parquet"])
def test_columnar_exact_is_false_for_binary_and_variable_lists(tmp_path: Path, fmt: str) -> None:
    reader = es.from_arrow if fmt == "arrow" else es.from_parquet
    data = [{"id": i, "blob": bytes([i]) * 3, "tokens": list(range(i % 4))} for i in range(8)]
    es.write(data, tmp_path / fmt, format=fmt, progress=False)
    assert not reader(str(tmp_path / fmt)).columnar_exact
    assert not reader(str(tmp_path / fmt), columns=["id", "blob"]).columnar_exact
    assert reader(str(tmp_path / fmt), columns=["id"]).columnar_exact
    cols = reader(str(tmp_path / fmt)).read_columns([3, 1])
    assert cols["blob"] == [b"\x03" * 3, b"\x01" * 3]
    assert [t.tolist() for t in cols["tokens"]] == [[0, 1, 2], [0]]


def test_read_columns_names_a_null(tmp_path: Path) -> None:
    write_ipc(tmp_path / "n.arrow", pa.table({"x": [1, None, 3]}), stream=False)
    src = es.from_arrow(str(tmp_path))
    assert src.read_columns([2, 0])["x"].tolist() == [3, 1]
    with pytest.raises(
        ValueError, match=r"column 'x' holds a null \(row 1 of the batch, sample 1\)"
    ):
        src.read_columns([0, 1])


# ---- the guarantees through evenly.Dataset / evenly.DataLoader -----------------------


def loader(src: Any, workers: int = 2) -> evenly.DataLoader:
    ds = evenly.Dataset(src, shuffle=True, seed=4)
    return evenly.DataLoader(ds, batch_size=7, num_workers=workers, timeout=60)


def test_every_row_once_per_epoch_with_two_workers(arrow_dir: str) -> None:
    dl = loader(es.from_arrow(arrow_dir))
    epochs = []
    for _ in range(2):
        batches = list(dl)
        assert all(b["pixels"].shape[1:] == (4,) for b in batches)  # default_collate stacks
        epochs.append([i for b in batches for i in b["id"].tolist()])
    for ids in epochs:
        assert sorted(ids) == list(range(N))
    assert epochs[0] != epochs[1]


def test_mid_epoch_state_resumes_exactly(arrow_dir: str) -> None:
    src = es.from_arrow(arrow_dir)
    first = loader(src)
    it = iter(first)
    seen = [i for _ in range(3) for i in next(it)["id"].tolist()]
    state = first.state_dict()
    del it
    resumed = loader(src, workers=1)
    resumed.load_state_dict(state)
    rest = [i for b in resumed for i in b["id"].tolist()]
    assert Counter(seen + rest) == Counter(range(N))


# ---- HF datasets on disk -------------------------------------------------------------


@pytest.fixture
def hf_dir(tmp_path: Path) -> str:
    datasets = pytest.importorskip("datasets")
    datasets.disable_progress_bars()
    ds = datasets.Dataset.from_dict({"id": list(range(30)), "x": [[i, i] for i in range(30)]})
    ds.save_to_disk(str(tmp_path / "hf"), num_shards=3)
    return str(tmp_path / "hf")


def test_save_to_disk_directory_read_exactly_once(hf_dir: str) -> None:
    src = es.from_arrow(hf_dir)
    assert len(src) == 30 and src.shard_sizes == (10, 10, 10)
    dl = evenly.DataLoader(
        evenly.Dataset(src, shuffle=True), batch_size=7, num_workers=2, timeout=60
    )
    assert sorted(i for b in dl for i in b["id"].tolist()) == list(range(30))


@pytest.mark.parametrize("how", ["select", "filter", "shuffle"])
def test_kept_rows_only_in_index_order(hf_dir: str, tmp_path: Path, how: str) -> None:
    import datasets

    loaded = datasets.load_from_disk(hf_dir)
    changed = {
        "select": lambda d: d.select([21, 3, 17, 4]),
        "filter": lambda d: d.filter(lambda r: r["id"] % 4 == 1),
        "shuffle": lambda d: d.shuffle(seed=2),
    }[how](loaded)
    assert changed._indices is not None  # a mapping over the same files, not a copy
    expected = list(changed["id"])
    from_object = es.from_arrow(changed)
    changed.save_to_disk(str(tmp_path / how))
    from_dir = es.from_arrow(str(tmp_path / how))
    for src in (from_object, from_dir):
        assert len(src) == len(expected)
        assert [r["id"] for r in src.__getitems__(list(range(len(src))))] == expected
    assert from_object.fingerprint != es.from_arrow(loaded).fingerprint
    dl = evenly.DataLoader(
        evenly.Dataset(from_object, shuffle=True), batch_size=3, num_workers=2, timeout=60
    )
    assert Counter(i for b in dl for i in b["id"].tolist()) == Counter(expected)


def test_an_old_style_indices_file_in_state_json_is_honoured(hf_dir: str) -> None:
    write_ipc(
        Path(hf_dir) / "indices.arrow",
        pa.table({"indices": pa.array([29, 0, 5], pa.uint64())}),
        stream=True,
    )
    state_path = Path(hf_dir) / "state.json"
    state = json.loads(state_path.read_text())
    state["_indices_data_files"] = [{"filename": "indices.arrow"}]
    state_path.write_text(json.dumps(state))
    src = es.from_arrow(hf_dir)
    assert [r["id"] for r in src.__getitems__([0, 1, 2])] == [29, 0, 5] and len(src) == 3


def test_what_cannot_be_read_from_the_files_is_refused(hf_dir: str, tmp_path: Path) -> None:
    import datasets

    loaded = datasets.load_from_disk(hf_dir)
    with pytest.raises(ValueError, match=r"differs from its cache files .*save_to_disk"):
        es.from_arrow(loaded.select(range(5, 10)))  # an in-memory slice of the table
    with pytest.raises(ValueError, match=r"columns \['y'\] are not in its cache files"):
        es.from_arrow(loaded.rename_column("x", "y"))
    with pytest.raises(ValueError, match="held in memory"):
        es.from_arrow(datasets.Dataset.from_dict({"a": [1]}))
    assert es.from_arrow(loaded.remove_columns("x"))[3] == {"id": 3}
    datasets.DatasetDict({"train": loaded}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(ValueError, match=r"DatasetDict \(splits \['train'\]\); pass one split"):
        es.from_arrow(str(tmp_path / "dd"))
    assert os.path.isdir(tmp_path / "dd" / "train")
