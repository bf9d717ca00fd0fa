"""Property tests of the pure planning core: every (rank, worker) share, every epoch."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from evenly.core.plan import EpochPlan
from tests.plans import make_plan


def worker_batches(plan: EpochPlan, rank: int, workers: int) -> list[list[list[int]]]:
    """Per worker, its batches (virtual positions) as the worker would yield them."""
    out = []
    for w in range(max(workers, 1)):
        batches: list[list[int]] = []
        for positions, length in plan.iter_worker_chunks(rank, workers, w, chunk=64):
            flat = positions.tolist()
            batches += [flat[i : i + length] for i in range(0, len(flat), length)]
        out.append(batches)
    return out


def dataloader_order(per_worker: list[list[list[int]]]) -> list[list[int]]:
    """The order a DataLoader collects batches in: round-robin, skipping ended workers."""
    result, cursors = [], [0] * len(per_worker)
    while any(c < len(b) for c, b in zip(cursors, per_worker, strict=True)):
        for w, batches in enumerate(per_worker):
            if cursors[w] < len(batches):
                result.append(batches[cursors[w]])
                cursors[w] += 1
    return result


plans = st.builds(
    make_plan,
    num_samples=st.integers(0, 5000),
    world_size=st.integers(1, 8),
    batch_size=st.integers(1, 64),
    drop_last=st.booleans(),
    shuffle=st.booleans(),
    seed=st.integers(0, 2**40),
    epoch=st.integers(0, 5),
)


@given(plan=plans, workers=st.integers(0, 8))
@settings(max_examples=300, deadline=None)
def test_exactly_once_equal_counts_one_partial_batch(plan: EpochPlan, workers: int) -> None:
    n, world, size = plan.num_samples, plan.world_size, plan.batch_size
    seen: Counter[int] = Counter()
    for rank in range(world):
        batches = dataloader_order(worker_batches(plan, rank, workers))
        # the same batch sequence whatever the number of workers
        assert batches == [
            plan.rank_positions(rank)[i * size : (i + 1) * size].tolist()
            for i in range(plan.num_batches)
        ]
        # equal batch and sample counts on every rank
        assert len(batches) == plan.num_batches
        assert sum(map(len, batches)) == plan.samples_per_rank
        # at most one partial batch, and only at the end
        assert all(len(b) == size for b in batches[:-1])
        if plan.drop_last:
            assert all(len(b) == size for b in batches)
        seen.update(p for b in batches for p in b)
    real = {p: c for p, c in seen.items() if p < n}
    pads = [p for p in seen if p >= n]
    # every real position exactly once, except the remainder drop_last leaves out
    assert set(real) == set(range(n - plan.num_dropped))
    assert set(real.values()) <= {1}
    assert sum(seen[p] for p in pads) == plan.num_padded < world
    assert plan.num_dropped < world * size
    assert plan.num_dropped == 0 or plan.drop_last
    # pads wrap to the start of the epoch's order
    indices = plan.indices(sorted(seen))
    order = plan.indices(np.arange(n)) if n else np.array([], dtype=np.int64)
    wrapped = [order[p % n] for p in range(plan.num_padded)] if n else []
    assert Counter(indices.tolist()) == Counter(order[: n - plan.num_dropped].tolist() + wrapped)


@given(plan=plans, data=st.data())
@settings(max_examples=200, deadline=None)
def test_a_resumed_plan_covers_exactly_the_rest(plan: EpochPlan, data: st.DataObject) -> None:
    start = data.draw(st.integers(0, plan.num_samples))
    resumed = make_plan(
        num_samples=plan.num_samples,
        world_size=plan.world_size,
        batch_size=plan.batch_size,
        drop_last=plan.drop_last,
        shuffle=plan.shuffle,
        seed=plan.seed,
        epoch=plan.epoch,
        start=start,
    )
    positions = [p for r in range(resumed.world_size) for p in resumed.rank_positions(r).tolist()]
    real = sorted(p for p in positions if p < plan.num_samples)
    assert real == list(range(start, plan.num_samples - resumed.num_dropped))
    assert len(positions) - len(real) == resumed.num_padded < resumed.world_size


@given(plan=plans, batches=st.integers(0, 200))
@settings(max_examples=200, deadline=None)
def test_consumed_batches_are_a_prefix_of_the_order(plan: EpochPlan, batches: int) -> None:
    done = min(batches, plan.num_batches)
    consumed = sorted(
        p
        for r in range(plan.world_size)
        for p in plan.batches_positions(r, np.arange(done)).tolist()
        if p < plan.num_samples
    )
    prefix = plan.consumed_after(done)
    assert consumed == list(range(plan.start, min(prefix, plan.num_samples)))


def test_shuffle_is_one_global_permutation_per_epoch() -> None:
    a = make_plan(num_samples=1000, world_size=4, batch_size=8, shuffle=True, seed=1, epoch=0)
    b = make_plan(num_samples=1000, world_size=4, batch_size=8, shuffle=True, seed=1, epoch=1)
    pos = np.arange(1000)
    order_a, order_b = a.indices(pos), b.indices(pos)
    assert sorted(order_a.tolist()) == list(range(1000))
    assert not np.array_equal(order_a, order_b)
    # the shuffle mixes across what would be any rank's or worker's contiguous shard
    first_batch = a.indices(a.batch_positions(0, 0))
    assert np.ptp(first_batch) > 250
    unshuffled = make_plan(num_samples=1000, world_size=4, batch_size=8)
    assert unshuffled.indices(pos).tolist() == list(range(1000))


@pytest.mark.parametrize("n", [10**9, 2**40 + 7])
@pytest.mark.parametrize("drop_last", [False, True])
def test_huge_plans_have_exact_sizes_and_disjoint_batches(n: int, drop_last: bool) -> None:
    plan = make_plan(
        num_samples=n, world_size=8, batch_size=32, drop_last=drop_last, shuffle=True, seed=5
    )
    assert plan.samples_per_rank * 8 == n - plan.num_dropped + plan.num_padded
    last = plan.num_batches - 1
    picks = [0, 1, last // 2, last]
    pos = np.concatenate([plan.batches_positions(r, picks) for r in range(8)])
    assert np.unique(pos).size == pos.size
    idx = plan.indices(pos[pos < n])
    assert np.unique(idx).size == idx.size and idx.min() >= 0 and idx.max() < n
    # padding repeats the start of the order: at most world_size - 1 virtual positions
    assert int((pos >= n).sum()) == plan.num_padded < 8


def test_fewer_samples_than_ranks_pads_every_rank_to_one_sample() -> None:
    plan = make_plan(num_samples=3, world_size=8, batch_size=4)
    assert (plan.num_batches, plan.samples_per_rank, plan.num_padded) == (1, 1, 5)
    assert plan.idle_workers(4) == 3
    assert sorted(
        plan.indices(np.concatenate([plan.rank_positions(r) for r in range(8)])).tolist()
    ) == [0, 0, 0, 1, 1, 1, 2, 2]
    dropped = make_plan(num_samples=3, world_size=8, batch_size=4, drop_last=True)
    assert (dropped.num_batches, dropped.num_dropped) == (0, 3)


def test_empty_source_plans_zero_batches() -> None:
    plan = make_plan(num_samples=0, world_size=3, batch_size=4, shuffle=True)
    assert (plan.num_batches, plan.samples_per_rank, plan.num_padded) == (0, 0, 0)
    assert plan.rank_positions(2).size == 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"batch_size": 0}, "batch_size must be >= 1, got 0"),
        ({"world_size": 0}, "world_size must be >= 1, got 0"),
        ({"seed": 1.5}, "seed must be an integer, got 1.5"),
        ({"start": 11}, "start position 11 is past the end of the epoch"),
    ],
)
def test_bad_settings_name_the_setting(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises((ValueError, TypeError), match=message):
        make_plan(num_samples=10, **kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"rank must lie in \[0, 2\), got 2"):
        make_plan(num_samples=10, world_size=2).rank_positions(2)
