"""``evenly.BatchSampler``: the plan's guarantees for map-style datasets, in one process
(ranks simulated with explicit ``rank``/``world_size``; real DataLoader workers where
prefetching matters)."""

from __future__ import annotations

import itertools
import json
import tracemalloc
import warnings
from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from evenly import EvenlyWarning, StateError
from evenly.core import FeistelPermutation
from evenly.loader.sampler import BatchSampler

pytestmark = pytest.mark.filterwarnings("ignore::evenly.EvenlyWarning")


def sampler(n: int, batch: int, rank: int = 0, world: int = 1, **kw: object) -> BatchSampler:
    return BatchSampler(n, batch, rank=rank, world_size=world, **kw)  # type: ignore[arg-type]


def epoch(n: int, batch: int, world: int, e: int = 0, **kw: object) -> list[list[list[int]]]:
    """Every rank's batches of epoch ``e``."""
    out = []
    for rank in range(world):
        s = sampler(n, batch, rank, world, **kw)
        s.set_epoch(e)
        out.append(list(s))
    return out


def flat(batches: list[list[int]]) -> list[int]:
    return [i for b in batches for i in b]


def order(n: int, seed: int, e: int, shuffle: bool = True) -> list[int]:
    if not shuffle or n == 0:
        return list(range(n))
    result: list[int] = FeistelPermutation(n, seed=seed, epoch=e)(np.arange(n)).tolist()
    return result


class Numbers(torch.utils.data.Dataset[int]):
    """A map-style dataset whose sample ``i`` is ``i``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        return index


def loader_of(n: int, s: BatchSampler, workers: int = 0) -> torch.utils.data.DataLoader[int]:
    return torch.utils.data.DataLoader(Numbers(n), batch_sampler=s, num_workers=workers)


# ---- the plan's guarantees ------------------------------------------------------------
@given(
    n=st.integers(0, 3000),
    world=st.integers(1, 8),
    batch=st.integers(1, 64),
    drop_last=st.booleans(),
    shuffle=st.booleans(),
    seed=st.integers(0, 2**40),
    e=st.integers(0, 4),
)
@settings(max_examples=200, deadline=None)
def test_exactly_once_over_ranks_equal_batches_minimal_padding(
    n: int, world: int, batch: int, drop_last: bool, shuffle: bool, seed: int, e: int
) -> None:
    ranks = epoch(n, batch, world, e, drop_last=drop_last, shuffle=shuffle, seed=seed)
    plan = sampler(n, batch, 0, world, drop_last=drop_last).plan
    # equal batch counts, as len() says; full batches but for the last one
    assert {len(b) for b in ranks} == {plan.num_batches}
    assert len(sampler(n, batch, 0, world, drop_last=drop_last)) == plan.num_batches
    for batches in ranks:
        assert all(len(b) == batch for b in batches[:-1])
        assert not drop_last or all(len(b) == batch for b in batches)
    # every sample once; padding repeats the start of the order; drops cut its end
    seen = Counter(i for batches in ranks for i in flat(batches))
    epoch_order = order(n, seed, e, shuffle)
    kept = epoch_order[: n - plan.num_dropped]
    repeats = [epoch_order[i % n] for i in range(plan.num_padded)]  # wraps if n < pads
    assert seen == Counter(kept + repeats)
    assert plan.num_padded < world
    assert plan.num_dropped < world * batch
    assert plan.num_dropped == 0 or drop_last


def test_the_shuffle_is_global_and_done_before_sharding() -> None:
    n, world, batch, seed = 1000, 4, 8, 5
    ranks = epoch(n, batch, world, seed=seed)
    global_order = order(n, seed, 0)
    for rank, batches in enumerate(ranks):
        for i, b in enumerate(batches[:-1]):  # full steps: rank r takes slot r of step i
            start = (i * world + rank) * batch
            assert b == global_order[start : start + batch]
    # a batch mixes samples from all over the dataset, not one rank's contiguous shard
    assert np.ptp(ranks[0][0]) > n // 4


@given(
    n=st.integers(20, 2000),
    world=st.integers(1, 4),
    batch=st.integers(1, 32),
    seed=st.integers(0, 2**40),
)
@settings(max_examples=50, deadline=None)
def test_each_iter_is_a_new_epoch_and_set_epoch_replays_one(
    n: int, world: int, batch: int, seed: int
) -> None:
    s = sampler(n, batch, world - 1, world, seed=seed)
    first, second = list(s), list(s)
    assert flat(first) != flat(second)
    assert s.epoch == 2
    s.set_epoch(0)
    assert list(s) == first
    assert list(s) == second  # and later passes follow the replayed one


@pytest.mark.parametrize(
    ("n", "world", "batch", "drop_last"), [(103, 2, 4, False), (1000, 3, 7, True)]
)
def test_the_same_batches_as_evenly_dataset(
    n: int, world: int, batch: int, drop_last: bool
) -> None:
    import evenly

    for rank in range(world):
        ds = evenly.Dataset(list(range(n)), shuffle=True, seed=9, rank=rank, world_size=world)
        loader = evenly.DataLoader(ds, batch_size=batch, drop_last=drop_last)
        s = sampler(n, batch, rank, world, seed=9, drop_last=drop_last)
        for _ in range(2):
            assert [b.tolist() for b in loader] == list(s)


# ---- checkpoints ------------------------------------------------------------------
@given(
    n=st.integers(0, 2000),
    world=st.integers(1, 6),
    batch=st.integers(1, 32),
    new_world=st.integers(1, 6),
    new_batch=st.integers(1, 32),
    drop_last=st.booleans(),
    seed=st.integers(0, 2**40),
    e=st.integers(0, 3),
    data=st.data(),
)
@settings(max_examples=150, deadline=None)
def test_resume_at_any_batch_under_another_world_size_and_batch_size_is_exact(
    n: int,
    world: int,
    batch: int,
    new_world: int,
    new_batch: int,
    drop_last: bool,
    seed: int,
    e: int,
    data: st.DataObject,
) -> None:
    kw = {"drop_last": drop_last, "seed": seed}
    old = [sampler(n, batch, r, world, **kw) for r in range(world)]
    k = data.draw(st.integers(0, old[0].plan.num_batches), label="batches received")
    received: list[int] = []
    states = []
    for s in old:
        s.set_epoch(e)
        received += flat(list(itertools.islice(iter(s), k)))
        states.append(json.loads(json.dumps(s.state_dict(batches_received=k))))
        if k == 0:  # between passes the sampler knows: no argument needed
            assert states[-1] == s.state_dict()
    assert all(state == states[0] for state in states)  # save any rank's

    new = [sampler(n, new_batch, r, new_world, **kw) for r in range(new_world)]
    for s in new:
        s.load_state_dict(states[0])
    if k == old[0].plan.num_batches > 0:  # the epoch was over: the next one starts afresh
        assert [s.epoch for s in new] == [e + 1] * new_world
        assert states[0]["position"] == 0
        return
    assert {len(s) for s in new} == {k + new[0].remaining_batches}
    rest = [list(s) for s in new]
    plan = sampler(n, new_batch, 0, new_world, **kw)
    plan.load_state_dict(states[0])
    padded, dropped = plan.plan.num_padded, plan.plan.num_dropped
    epoch_order = order(n, seed, e)
    assert Counter(received + [i for r in rest for i in flat(r)]) == Counter(
        epoch_order[: n - dropped] + [epoch_order[i % n] for i in range(padded)]
    )
    assert {len(r) for r in rest} == {plan.plan.num_batches}
    # the pass after the resumed one is the next epoch, from its start
    assert [list(s) for s in new] == epoch(n, new_batch, new_world, e + 1, **kw)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_default_state_mid_pass_is_refused_naming_batches_received(workers: int) -> None:
    n, batch = 101, 10
    s = sampler(n, batch, seed=4)
    loader = loader_of(n, s, workers=workers)
    it = iter(loader)
    head = [next(it).tolist() for _ in range(4)]
    # the sampler handed out 4 batches (0 workers) or more (prefetch): it cannot tell
    # which, so a default state is refused when it is loaded, and the loop that took it
    # stops at its next batch
    unsure = s.state_dict()
    with pytest.raises(StateError, match=r"batches_received.*StatefulDataLoader"):
        next(it)
    del it
    refused = sampler(n, batch, seed=4)
    refused.load_state_dict(unsure)
    with pytest.raises(StateError, match=r"state_dict\(\s*batches_received="):
        list(refused)
    state = s.state_dict(batches_received=4)
    assert (state["epoch"], state["position"], state["batches"]) == (0, 40, 4)
    fresh = sampler(n, batch, seed=4)
    fresh.load_state_dict(state)
    tail = [b.tolist() for b in loader_of(n, fresh)]
    assert head + tail == epoch(n, batch, 1, 0, seed=4)[0]
    # the abandoned loop's loader moves on to epoch 1, like the resumed one
    assert [b.tolist() for b in loader] == list(fresh) == epoch(n, batch, 1, 1, seed=4)[0]


def test_batches_received_makes_resume_exact_with_prefetching_workers() -> None:
    n, batch, k = 200, 5, 7
    s = sampler(n, batch, seed=2)
    loader = loader_of(n, s, workers=2)
    it = iter(loader)
    head = [next(it).tolist() for _ in range(k)]
    s.state_dict()  # the workers prefetched more than the loop received: refused
    with pytest.raises(StateError, match="batches_received"):
        next(it)
    state = s.state_dict(batches_received=k)
    del it
    fresh = sampler(n, batch, seed=2)
    fresh.load_state_dict(state)
    assert head + list(fresh) == epoch(n, batch, 1, 0, seed=2)[0]


def test_len_after_a_load_counts_the_batches_received_before_it() -> None:
    s = sampler(1001, 10, 0, 2)
    assert len(s) == 51
    it = iter(s)
    for _ in range(20):
        next(it)
    state = s.state_dict(batches_received=20)
    fresh = sampler(1001, 10, 1, 2)
    fresh.load_state_dict(state)
    assert (len(fresh), fresh.remaining_batches) == (51, 31)
    assert len(list(fresh)) == 31
    assert (len(fresh), fresh.remaining_batches) == (51, 51)  # the next epoch, from its start


def test_set_epoch_keeps_a_loaded_position_of_that_epoch_only() -> None:
    s = sampler(100, 10, seed=1)
    s.set_epoch(3)
    full = list(s)
    s.set_epoch(3)
    it = iter(s)
    next(it), next(it)
    state = s.state_dict(batches_received=2)
    resumed = sampler(100, 10, seed=1)
    resumed.load_state_dict(state)
    resumed.set_epoch(3)  # as Lightning does before the resumed epoch
    assert list(resumed) == full[2:]
    resumed.load_state_dict(state)
    resumed.set_epoch(4)
    assert list(resumed) == epoch(100, 10, 1, 4, seed=1)[0]


def test_set_epoch_during_a_pass_sets_the_next_one() -> None:
    s = sampler(30, 10, seed=1)
    it = iter(s)
    first = next(it)
    s.set_epoch(7)  # the pass in progress (epoch 0) is not affected
    assert (s.epoch, len(s), s.state_dict(batches_received=1)["position"]) == (0, 3, 10)
    assert [first, *it] == epoch(30, 10, 1, 0, seed=1)[0]
    state = s.state_dict()
    assert (state["epoch"], state["position"]) == (7, 0)
    s.set_epoch(2)  # between passes: the state points at the epoch set
    assert s.state_dict()["epoch"] == s.epoch == 2
    assert list(s) == epoch(30, 10, 1, 2, seed=1)[0]


def test_a_state_for_another_plan_is_refused_naming_the_fields() -> None:
    state = sampler(100, 10, seed=0).state_dict()
    with pytest.raises(StateError, match=r"num_samples: saved 100.*seed: saved 0"):
        sampler(101, 10, seed=1).load_state_dict(state)
    with pytest.raises(StateError, match="shuffle"):
        sampler(100, 10, shuffle=False).load_state_dict(state)
    with pytest.raises(ValueError, match=r"state\['batches'\] must be >= 0"):
        sampler(100, 10).load_state_dict({**state, "batches": -1})
    with pytest.raises(StateError, match="version"):
        sampler(100, 10).load_state_dict({**state, "version": 99})


def test_bad_arguments_raise_naming_the_setting_and_the_fix() -> None:
    with pytest.raises(TypeError, match=r"len\(dataset\)"):
        BatchSampler(list(range(10)), 2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        BatchSampler(10, 0)
    with pytest.raises(ValueError, match="rank 2 is out of range for world_size 2"):
        BatchSampler(10, 2, rank=2, world_size=2)
    with pytest.raises(TypeError, match="shuffle must be True or False"):
        BatchSampler(10, 2, shuffle="global")  # type: ignore[arg-type]
    s = sampler(10, 2)
    with pytest.raises(ValueError, match="no pass is in progress"):
        s.state_dict(batches_received=1)
    list(s)
    with pytest.raises(ValueError, match=r"batches_received=6, but rank 0 has only 5"):
        s.state_dict(batches_received=6)


@pytest.mark.filterwarnings("error")
def test_padding_and_empty_epochs_are_reported() -> None:
    padded = sampler(11, 3, 0, 2)
    assert padded.plan.num_padded == 1
    with pytest.warns(EvenlyWarning, match=r"1 sample\(s\) repeated"):
        list(padded)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        list(sampler(12, 3, 0, 2))  # exact: no warning
    with pytest.warns(EvenlyWarning, match="0 batches"):
        assert list(sampler(0, 3, 0, 2)) == []


def test_a_billion_samples_plan_in_constant_memory() -> None:
    n, world, batch = 10**9, 8, 1024
    tracemalloc.start()
    try:
        s = sampler(n, batch, 3, world, seed=11)
        it = iter(s)
        batches = [next(it) for _ in range(3)]
        state = s.state_dict(batches_received=3)
        resumed = sampler(n, batch, 0, 1, seed=11)
        resumed.load_state_dict(state)
        after = next(iter(resumed))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 * 2**20  # an order of N int64 would be 8 GB
    assert len(s) == -(-n // (world * batch)) and state["position"] == 3 * world * batch
    everything = flat(batches) + after
    assert len(set(everything)) == len(everything) == 4 * batch
    assert all(0 <= i < n for i in everything)
