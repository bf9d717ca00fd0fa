"""Batch hand-off and columnar batches: workers read and collate a whole batch
and hand it over as one item, and every guarantee still holds (exactly once, equal
batches, the map-style sequence, exact resume under a worker or rank change)."""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import torch
import torch.utils.data as tud

import evenly

MAIN = os.getpid()


class RecordingCollate:
    """default_collate that also records which process collated each batch."""

    def __call__(self, samples: list[Any]) -> dict[str, Any]:
        return {"x": tud.default_collate(samples), "pid": os.getpid(), "size": len(samples)}


def test_workers_collate_whole_batches_and_the_loader_keeps_the_users_settings() -> None:
    collate = RecordingCollate()
    ds = evenly.Dataset(list(range(50)), shuffle=True, seed=3)
    loader = evenly.DataLoader(ds, batch_size=8, num_workers=2, collate_fn=collate)
    batches = list(loader)
    assert {b["pid"] for b in batches} - {MAIN} == {b["pid"] for b in batches}  # in workers
    assert [b["size"] for b in batches] == [8] * 6 + [2]
    assert sorted(int(x) for b in batches for x in b["x"]) == list(range(50))
    # what a framework reads to rebuild a loader is the user's, not the hand-off's
    assert loader.batch_size == 8 and loader.collate_fn is collate and loader.num_workers == 2


def test_a_loader_rebuilt_from_the_dataset_never_makes_batches_of_batches() -> None:
    """As Accelerate's prepare() does: a new DataLoader from loader.dataset/batch_size."""
    ds = evenly.Dataset(list(range(40)), shuffle=True)
    loader = evenly.DataLoader(ds, batch_size=4, num_workers=2)
    rebuilt = tud.DataLoader(
        loader.dataset, batch_size=loader.batch_size, collate_fn=loader.collate_fn, num_workers=2
    )
    batches = list(rebuilt)
    assert all(b.shape == (4,) for b in batches)
    assert sorted(int(x) for b in batches for x in b) == list(range(40))


def test_batch_size_none_hands_over_single_samples_converted_as_torch_does() -> None:
    ds = evenly.Dataset([np.int64(i) for i in range(6)])
    items = list(evenly.DataLoader(ds, batch_size=None, num_workers=2))
    assert sorted(int(x) for x in items) == list(range(6))
    assert all(isinstance(x, torch.Tensor) and x.shape == () for x in items)


# ---- columnar batches over Arrow files ---------------------------------------------------
N, WIDTH = 203, 16


@pytest.fixture(scope="module")
def arrow_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    out = tmp_path_factory.mktemp("arrow")
    rng = np.random.default_rng(0)
    schema = pa.schema([("idx", pa.int64()), ("data", pa.list_(pa.uint8(), WIDTH))])
    rows = ({"idx": i, "data": rng.integers(0, 255, WIDTH, dtype=np.uint8)} for i in range(N))
    evenly.write(rows, out, format="arrow", rows_per_shard=50, schema=schema, progress=False)
    return str(out)


def source(arrow_dir: str, tmp: Path) -> Any:
    return evenly.from_arrow(arrow_dir, cache_dir=str(tmp / "cache"))


def columns_of(loader: Any) -> list[dict[str, torch.Tensor]]:
    return [{k: v.clone() for k, v in b.items()} for b in loader]


def test_columnar_batches_equal_the_per_sample_ones(arrow_dir: str, tmp_path: Path) -> None:
    src = source(arrow_dir, tmp_path)
    assert src.columnar_exact
    auto = evenly.DataLoader(evenly.Dataset(src, shuffle=True), batch_size=16, num_workers=2)
    rows = evenly.DataLoader(
        evenly.Dataset(src, shuffle=True), batch_size=16, num_workers=2, columnar=False
    )
    a, b = columns_of(auto), columns_of(rows)
    assert len(a) == len(b) == 13
    for x, y in zip(a, b, strict=True):
        assert x["idx"].dtype == y["idx"].dtype == torch.int64
        assert x["data"].shape[1:] == (WIDTH,) and x["data"].dtype == torch.uint8
        assert torch.equal(x["idx"], y["idx"]) and torch.equal(x["data"], y["data"])


def test_a_transform_turns_columnar_off(arrow_dir: str, tmp_path: Path) -> None:
    ds = evenly.Dataset(source(arrow_dir, tmp_path), transform=lambda r: r["idx"])
    loader = evenly.DataLoader(ds, batch_size=10)
    assert sorted(int(x) for b in loader for x in b) == list(range(N))
    with pytest.raises(TypeError, match="has no read_columns"):
        list(evenly.DataLoader(evenly.Dataset(list(range(4))), batch_size=2, columnar=True))


@pytest.mark.filterwarnings("ignore:evenly. 1 sample.s. repeated:evenly.EvenlyWarning")
def test_columnar_exactly_once_over_ranks_and_resume(arrow_dir: str, tmp_path: Path) -> None:
    src = source(arrow_dir, tmp_path)
    seen: Counter[int] = Counter()
    counts = []
    for rank in range(2):
        ds = evenly.Dataset(src, shuffle=True, seed=1, rank=rank, world_size=2)
        batches = columns_of(evenly.DataLoader(ds, batch_size=8, num_workers=2))
        counts.append(len(batches))
        seen.update(int(i) for b in batches for i in b["idx"])
    assert counts[0] == counts[1]
    assert set(seen) == set(range(N)) and sum(seen.values()) == N + 1  # one pad

    # stop after 5 batches per rank (2 ranks, 2 workers), resume on 3 ranks x 1 worker
    got: list[int] = []
    states = []
    for rank in range(2):
        ds = evenly.Dataset(src, shuffle=True, seed=1, rank=rank, world_size=2)
        loader = evenly.DataLoader(ds, batch_size=8, num_workers=2)
        it = iter(loader)
        got += [int(i) for _ in range(5) for i in next(it)["idx"]]
        states.append(json.loads(json.dumps(loader.state_dict())))
        del it
    assert states[0] == states[1]
    for rank in range(3):
        ds = evenly.Dataset(src, shuffle=True, seed=1, rank=rank, world_size=3)
        loader = evenly.DataLoader(ds, batch_size=8, num_workers=1)
        loader.load_state_dict(states[0])
        got += [int(i) for b in loader for i in b["idx"]]
    counts_after = Counter(got)
    assert set(counts_after) == set(range(N))
    assert sum(counts_after.values()) - N < 3  # at most world_size - 1 pads


def test_the_numpy_gather_equals_default_collate_of_the_rows(tmp_path: Path) -> None:
    """Local Arrow files of fixed-width numbers are gathered with numpy (int32 collated to
    int64, float32 to float64 as default_collate does for Python numbers)."""
    schema = pa.schema([("i", pa.int32()), ("f", pa.float32()), ("v", pa.list_(pa.float32(), 3))])
    rows = ({"i": i, "f": i / 7, "v": np.full(3, i, dtype=np.float32)} for i in range(90))
    evenly.write(
        rows,
        tmp_path / "a",
        format="arrow",
        rows_per_shard=40,
        schema=schema,
        row_group_size=16,
        progress=False,
    )
    src = evenly.from_arrow(str(tmp_path / "a"), cache_dir=str(tmp_path / "cache"))
    assert src._gather(np.array([0, 1])) is not None  # the numpy path is the one under test
    batch = [77, 3, 41, 3, 89, 0, 16, 15]
    got = src.read_columns(batch)
    want = tud.default_collate([src[i] for i in batch])
    for name in ("i", "f", "v"):
        tensor = torch.from_numpy(got[name])
        assert tensor.dtype == want[name].dtype and torch.equal(tensor, want[name]), name
