"""Columnar batches read several at a time (``read_column_batches``: one chunk lookup and
one check of each mapped file for a group of batches): the same batches in the same
order as one read per batch, every sample once, exact resume, and a failing group read
again batch by batch so the good batches before the bad one still arrive."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import evenly
import evenly.sources as es
from evenly.core.plan import CHUNK
from evenly.sources._gather import ChunkLookup

#: more than one plan chunk of positions, several groups of batches per chunk
N, BATCH = CHUNK + 3000, 64


@given(
    st.lists(st.integers(0, 9), min_size=1, max_size=12).filter(any),
    st.lists(st.integers(0, 10**6), min_size=1, max_size=40),
)
@settings(max_examples=200, deadline=None)
def test_chunk_lookup_equals_the_binary_search(sizes: list[int], picks: list[int]) -> None:
    starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    rows = np.array(picks, dtype=np.int64) % int(starts[-1])
    expected = np.searchsorted(starts, rows, side="right") - 1
    assert ChunkLookup(starts).of(rows).tolist() == expected.tolist()


@pytest.fixture(scope="module")
def arrow_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("grouped")
    schema = pa.schema([("id", pa.int64()), ("data", pa.list_(pa.uint8(), 8))])
    rows = ({"id": i, "data": np.full(8, i % 251, np.uint8)} for i in range(N))
    evenly.write(rows, root, "arrow", 1500, schema=schema, progress=False)
    return str(root)


def ids(loader: Any) -> list[int]:
    return [int(x) for b in loader for x in b["id"]]


def test_grouped_batches_equal_one_read_per_batch(arrow_dir: str) -> None:
    """Arrow columnar batches (read in groups) against the per-sample path's batches."""
    ds = evenly.Dataset(es.from_arrow(arrow_dir), shuffle=True, seed=3)
    columnar = evenly.DataLoader(ds, batch_size=BATCH, columnar=True)
    rows = evenly.DataLoader(ds, batch_size=BATCH, columnar=False)
    got = [b for b in columnar]
    assert [int(x) for b in got for x in b["id"]] == ids(rows)
    assert sorted(int(x) for b in got for x in b["id"]) == list(range(N))
    assert [len(b["id"]) for b in got] == [BATCH] * (N // BATCH) + [N % BATCH]
    for b in got[::50]:  # each row's data is its own
        assert (b["data"].numpy() == (b["id"].numpy() % 251)[:, None]).all()


def test_read_column_batches_equals_read_columns(arrow_dir: str) -> None:
    src = es.from_arrow(arrow_dir)
    rng = np.random.default_rng(0)
    batches = [rng.permutation(N)[:k] for k in (5, 64, 1, 64)]
    for source in (src, es.from_arrow(arrow_dir, columns=["id"])):
        grouped = source.read_column_batches(batches)
        for b, columns in zip(batches, grouped, strict=True):
            single = source.read_columns(b)
            assert columns.keys() == single.keys()
            for name in single:
                assert np.array_equal(np.asarray(columns[name]), np.asarray(single[name]))


@pytest.mark.parametrize("skip", [3, 40])
def test_a_resume_inside_a_group_continues_exactly(arrow_dir: str, skip: int) -> None:
    ds = evenly.Dataset(es.from_arrow(arrow_dir), shuffle=True, seed=5)
    first = evenly.DataLoader(ds, batch_size=BATCH, columnar=True)
    it = iter(first)
    seen = [int(x) for _ in range(skip) for x in next(it)["id"]]
    state = first.state_dict()
    del it
    again = evenly.DataLoader(ds, batch_size=BATCH, columnar=True)
    whole = ids(again)
    resumed = evenly.DataLoader(ds, batch_size=BATCH, columnar=True)
    resumed.load_state_dict(state)
    assert seen + ids(resumed) == whole


class _BadSample:
    """A columnar source that reads groups, and cannot read sample ``bad``."""

    def __init__(self, n: int, bad: int) -> None:
        self.n, self.bad = n, bad
        self.group_calls = 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, int]:
        return {"id": i}

    def read_columns(self, indices: Sequence[int]) -> dict[str, Any]:
        idx = np.asarray(indices, dtype=np.int64)
        if (idx == self.bad).any():
            raise ValueError(f"sample {self.bad} is unreadable")
        return {"id": idx.copy()}

    def read_column_batches(self, batches: Sequence[Sequence[int]]) -> list[dict[str, Any]]:
        self.group_calls += 1
        return [self.read_columns(b) for b in batches]


def test_a_failing_group_is_read_again_batch_by_batch() -> None:
    source = _BadSample(4000, bad=1000)
    ds = evenly.Dataset(source, shuffle=False)
    loader = evenly.DataLoader(ds, batch_size=10, columnar=True)
    got: list[int] = []
    with pytest.raises(ValueError, match="sample 1000 is unreadable") as info:
        for b in loader:
            got.extend(int(x) for x in b["id"])
    assert got == list(range(1000))  # every batch before the bad one, nothing twice
    assert any("a batch of samples [1000, 1001" in n for n in info.value.__notes__)
    assert source.group_calls > 1  # the batches were read in groups
