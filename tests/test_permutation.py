"""The keyed permutation: a bijection, uniform-looking, O(1) per position."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from evenly.core.permutation import FeistelPermutation, sample_seeds


@given(n=st.integers(0, 5000), seed=st.integers(-(2**63), 2**63), epoch=st.integers(0, 10**6))
@settings(max_examples=200, deadline=None)
def test_is_a_bijection_of_range_n(n: int, seed: int, epoch: int) -> None:
    out = FeistelPermutation(n, seed=seed, epoch=epoch)(np.arange(n))
    assert out.dtype == np.int64
    assert np.array_equal(np.sort(out), np.arange(n))


@given(n=st.integers(2, 5000), seed=st.integers(0, 2**32))
@settings(max_examples=50, deadline=None)
def test_any_position_alone_agrees_with_the_whole(n: int, seed: int) -> None:
    perm = FeistelPermutation(n, seed=seed, epoch=3)
    whole = perm(np.arange(n))
    picks = np.array([0, n // 2, n - 1, n // 3])
    assert np.array_equal(perm(picks), whole[picks])


def _spearman(order: np.ndarray) -> float:
    # positions and values are both permutations of 0..n-1: Spearman = Pearson of the two
    pos = np.arange(order.size, dtype=np.float64)
    return float(np.corrcoef(pos, order.astype(np.float64))[0, 1])


@pytest.mark.parametrize("n", [1000, 4097, 100_000, 1_000_003])
def test_order_looks_uniform(n: int) -> None:
    perm = FeistelPermutation(n, seed=7, epoch=0)
    order = perm(np.arange(n))
    # every element hit once
    assert np.bincount(order, minlength=n).max() == 1
    # no position/index rank correlation: |rho| is ~ 1/sqrt(n) for a uniform shuffle
    assert abs(_spearman(order)) < 5 / np.sqrt(n)
    # mean displacement |order[p] - p| of a uniform shuffle is (n^2-1)/(3n) ~ n/3
    displacement = np.abs(order - np.arange(n)).mean()
    assert displacement == pytest.approx(n / 3, rel=0.03)
    # fixed points: ~1 expected for a uniform permutation, not a structured map
    assert int((order == np.arange(n)).sum()) < 10


def test_epochs_and_seeds_give_unrelated_orders() -> None:
    n = 50_000
    base = FeistelPermutation(n, seed=0, epoch=0)(np.arange(n))
    for other in (
        FeistelPermutation(n, seed=0, epoch=1)(np.arange(n)),
        FeistelPermutation(n, seed=1, epoch=0)(np.arange(n)),
    ):
        # agreement at a position happens with probability 1/n
        assert int((base == other).sum()) < 10
        assert abs(float(np.corrcoef(base, other)[0, 1])) < 5 / np.sqrt(n)


def test_a_billion_samples_without_a_billion_sized_array() -> None:
    n = 10**9
    perm = FeistelPermutation(n, seed=0, epoch=0)
    positions = np.concatenate([np.arange(10_000), np.arange(n - 10_000, n)])
    out = perm(positions)
    assert out.min() >= 0 and out.max() < n
    assert np.unique(out).size == positions.size
    # the values spread over the whole range, not the neighbourhood of the positions
    assert out.mean() == pytest.approx(n / 2, rel=0.05)


def test_out_of_range_positions_are_rejected() -> None:
    perm = FeistelPermutation(10, seed=0, epoch=0)
    with pytest.raises(IndexError, match=r"\[0, 10\)"):
        perm([10])
    with pytest.raises(ValueError, match=">= 0"):
        FeistelPermutation(-1, seed=0, epoch=0)


def test_sample_seeds_are_distinct_and_depend_on_seed_epoch_position() -> None:
    pos = np.arange(100_000)
    a = sample_seeds(0, 0, pos)
    assert np.unique(a).size == pos.size
    assert not np.array_equal(a, sample_seeds(0, 1, pos))
    assert not np.array_equal(a, sample_seeds(1, 0, pos))
    assert np.array_equal(a[[5, 9]], sample_seeds(0, 0, [5, 9]))
