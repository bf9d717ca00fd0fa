"""Per-sample seeding written straight into the generators (``runtime/mtstate.py``): the
same states ``random.setstate`` / ``numpy.random.set_state`` set, every sample's stream
its own whatever the samples before it drew (cached Gaussians included), the user's
state put back."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import torch

import evenly
from evenly.runtime import mtstate
from evenly.runtime.seeds import RngState, SeedSpreader


def words(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 2**32, size=624, dtype=np.uint32)


def test_the_fast_writers_set_exactly_the_state_the_documented_calls_set() -> None:
    saved = RngState()
    try:
        fast, slow = mtstate.python_writer(), mtstate.python_writer(direct=False)
        assert fast.__name__ == "fast"  # CPython: the fast path is in use (not the fallback)
        for seed in range(3):
            w = words(seed)
            random.gauss(0, 1)  # leaves a cached Gaussian that a write must clear
            slow(w.ctypes.data)
            expected = random.getstate(), [random.gauss(0, 1) for _ in range(3)]
            random.gauss(0, 1)
            fast(w.ctypes.data)
            assert (random.getstate(), [random.gauss(0, 1) for _ in range(3)]) == expected
            assert random.getstate()[1][:624] != words(seed + 1).tolist()

        np_fast, touched = mtstate.numpy_writer()
        np_slow, _ = mtstate.numpy_writer(direct=False)
        assert np_fast.__name__ == "fast"
        for seed in range(3):
            w = words(seed)
            np_slow(w.ctypes.data)
            expected_np = np.random.random(700)  # past one twist of the 624 words
            np_fast(w.ctypes.data)
            assert not touched()
            assert np.array_equal(np.random.random(700), expected_np)
            assert touched()
    finally:
        saved.restore()


def draws(x: int) -> tuple[int, float, float, float, float]:
    """Odd samples draw first (a cached normal left behind); a few only touch numpy."""
    if x % 2:
        np.random.standard_normal()
        random.gauss(0, 1)
    numpy_draw = float(np.random.standard_normal()) if x % 3 else -1.0
    return x, numpy_draw, random.gauss(0, 1), float(np.random.random()), float(torch.rand(()))


def per_sample(batch_size: int, workers: int, transform: Any = draws) -> dict[int, Any]:
    ds = evenly.Dataset(list(range(24)), shuffle=True, seed=11, transform=transform)
    loader = evenly.DataLoader(ds, batch_size=batch_size, num_workers=workers)
    out = {}
    for batch in loader:
        for row in zip(*batch, strict=True):
            out[int(row[0])] = tuple(float(v) for v in row[1:])
    return out


def test_each_samples_stream_is_its_own_whatever_the_samples_before_it_drew() -> None:
    """A sample read alone in its batch (batch 1) draws what it draws after other samples
    that left cached Gaussians or touched numpy and not (batch 8, 2 workers)."""
    alone = per_sample(batch_size=1, workers=0)
    assert per_sample(batch_size=8, workers=0) == alone
    assert per_sample(batch_size=8, workers=2) == alone
    normals = [v[0] for v in alone.values() if v[0] != -1.0]
    assert len(set(normals)) == len(normals) == 16


def test_a_generator_first_touched_mid_transform_gets_the_samples_stream() -> None:
    """numpy drawn only after a random draw decides to, late in the transform, gives
    that sample the numpy stream it gets when numpy is drawn first thing."""

    def first(x: int) -> tuple[int, float]:
        return x, float(np.random.random())

    def late(x: int) -> tuple[int, float]:
        if random.random() < 0.5:
            return x, -1.0
        torch.rand(3)
        return x, float(np.random.random())

    expected = per_sample(batch_size=6, workers=0, transform=first)
    got = per_sample(batch_size=6, workers=0, transform=late)
    touched = {x: v for x, v in got.items() if v != (-1.0,)}
    assert 0 < len(touched) < len(got)
    assert touched == {x: expected[x] for x in touched}


def test_the_users_cached_gaussians_survive_and_do_not_leak_in() -> None:
    ds = evenly.Dataset(list(range(12)), transform=draws, seed=3)
    loader = evenly.DataLoader(ds, batch_size=4, generator=torch.Generator())
    reference = [tuple(map(float, row[1:])) for b in loader for row in zip(*b, strict=True)]
    np.random.seed(5)
    random.seed(5)
    np.random.standard_normal()  # each leaves its second normal cached
    random.gauss(0, 1)
    expected = (float(np.random.standard_normal()), random.gauss(0, 1))
    np.random.seed(5)
    random.seed(5)
    np.random.standard_normal()
    random.gauss(0, 1)
    loader.set_epoch(0)
    got = [tuple(map(float, row[1:])) for b in loader for row in zip(*b, strict=True)]
    assert got == reference  # nothing of the user's state reached the samples
    assert (float(np.random.standard_normal()), random.gauss(0, 1)) == expected


@pytest.mark.parametrize("generators", [("random",), ("numpy",), ("random", "numpy", "torch")])
def test_the_spreader_seeds_the_states_hashed_from_the_samples_seed(
    generators: tuple[str, ...],
) -> None:
    """Distinct seeds give distinct full states; the same seed in another batch (at
    another index) gives the same state."""
    seeds = evenly.core.EpochPlan(num_samples=64, seed=2).seeds(np.arange(64))
    saved = RngState()
    try:
        spreader = SeedSpreader(generators)
        spreader.prepare(seeds)
        spreader.seed(5)
        state = random.getstate(), np.random.get_state()[1].tolist()
        spreader.seed(6)
        assert (random.getstate(), np.random.get_state()[1].tolist()) != state
        spreader.prepare(seeds[5:9])
        spreader.seed(0)
        assert (random.getstate(), np.random.get_state()[1].tolist()) == state
        for outside in (4, -1):  # the states are read by address: never past the batch
            with pytest.raises(IndexError):
                spreader.seed(outside)
    finally:
        saved.restore()
