"""The block shuffle: a bijection for any shard sizes, local to windows of K shards."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from evenly.core.block import BlockPermutation
from tests.plans import make_plan

sizes_st = st.lists(st.integers(min_value=0, max_value=40), min_size=0, max_size=30)


def _shard_of(sizes: list[int], indices: np.ndarray) -> np.ndarray:
    starts = np.concatenate([[0], np.cumsum(sizes)])
    return np.searchsorted(starts, indices, side="right") - 1


@settings(max_examples=200, deadline=None)
@given(sizes_st, st.integers(1, 12), st.integers(0, 2**40), st.integers(0, 50))
def test_bijection(sizes: list[int], window: int, seed: int, epoch: int) -> None:
    perm = BlockPermutation(sizes, window, seed=seed, epoch=epoch)
    n = sum(sizes)
    out = perm(np.arange(n))
    assert out.dtype == np.int64
    assert sorted(out.tolist()) == list(range(n))


@settings(max_examples=200, deadline=None)
@given(sizes_st, st.integers(1, 12), st.integers(0, 2**40), st.integers(0, 50))
def test_windows_hold_k_shards(sizes: list[int], window: int, seed: int, epoch: int) -> None:
    perm = BlockPermutation(sizes, window, seed=seed, epoch=epoch)
    n = sum(sizes)
    shards = _shard_of(sizes, perm(np.arange(n)))
    # positions walk the windows in order: window w covers its shards' samples, contiguously
    lo = 0
    for w in range(perm.num_windows):
        members = perm.window_shards(w)
        assert len(members) <= window
        size = sum(sizes[s] for s in members)
        assert set(shards[lo : lo + size].tolist()) <= set(members)
        lo += size
    assert lo == n
    # so a run of consecutive positions no longer than the smallest window touches at
    # most two adjacent windows: at most 2K shards (what a worker's chunk needs at once)
    sizes_w = [sum(sizes[s] for s in perm.window_shards(w)) for w in range(perm.num_windows)]
    run = min([x for x in sizes_w if x] or [1])
    for start in range(0, n, max(1, run // 2)):
        assert len(set(shards[start : start + run].tolist())) <= 2 * window


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(1, 30), min_size=1, max_size=20), st.integers(0, 2**30))
def test_window_of_all_shards_is_a_global_permutation(sizes: list[int], seed: int) -> None:
    perm = BlockPermutation(sizes, len(sizes), seed=seed, epoch=0)
    assert perm.num_windows == 1
    assert sorted(perm(np.arange(sum(sizes))).tolist()) == list(range(sum(sizes)))


def test_deterministic_and_new_each_epoch() -> None:
    sizes = [100] * 16
    a = BlockPermutation(sizes, 4, seed=7, epoch=0)(np.arange(1600))
    b = BlockPermutation(sizes, 4, seed=7, epoch=0)(np.arange(1600))
    c = BlockPermutation(sizes, 4, seed=7, epoch=1)(np.arange(1600))
    d = BlockPermutation(sizes, 4, seed=8, epoch=0)(np.arange(1600))
    assert np.array_equal(a, b)
    assert not np.array_equal(a, c)
    assert not np.array_equal(a, d)
    # shard orders differ across epochs, so windows hold other shard sets
    orders = {tuple(BlockPermutation(sizes, 4, seed=7, epoch=e).window_shards(0)) for e in range(8)}
    assert len(orders) > 1


def test_pinned_order() -> None:
    """Cross-version determinism: a change here changes every saved run's order."""
    perm = BlockPermutation([3, 0, 4, 2, 0, 5], 2, seed=1, epoch=2)
    assert perm(np.arange(14)).tolist() == [7, 8, 11, 9, 10, 13, 12, 4, 2, 1, 5, 6, 3, 0]


def test_shuffles_inside_a_window() -> None:
    sizes = [1000] * 8
    perm = BlockPermutation(sizes, 4, seed=0, epoch=0)
    shards = _shard_of(sizes, perm(np.arange(8000)))
    # inside a window of 4 shards, consecutive samples come from the same shard ~1/4 of the time
    same = float(np.mean(shards[1:4000] == shards[:3999]))
    assert 0.18 < same < 0.32
    # and positions do not follow the index order (rank correlation inside the window)
    first = perm(np.arange(4000))
    assert abs(np.corrcoef(np.arange(4000), np.argsort(np.argsort(first)))[0, 1]) < 0.1


def test_argument_errors() -> None:
    with pytest.raises(ValueError, match="window must be an integer >= 1"):
        BlockPermutation([1, 2], 0, seed=0, epoch=0)
    with pytest.raises(ValueError, match="shard sizes must be >= 0, got -1 for shard 1"):
        BlockPermutation([1, -1], 2, seed=0, epoch=0)
    with pytest.raises(IndexError, match=r"positions must lie in \[0, 3\)"):
        BlockPermutation([1, 2], 1, seed=0, epoch=0)([3])


def test_epoch_plan_uses_block_permutation() -> None:
    sizes = (5, 7, 0, 4, 8)
    plan = make_plan(
        num_samples=24, world_size=2, batch_size=3, shuffle=True, shard_sizes=sizes, block_shards=2
    )
    got = np.concatenate([plan.indices(plan.rank_positions(r)) for r in range(2)])
    assert sorted(got.tolist()) == list(range(24))
    expected = BlockPermutation(sizes, 2, seed=0, epoch=0)(np.arange(24))
    assert np.array_equal(plan.indices(np.arange(24)), expected)
