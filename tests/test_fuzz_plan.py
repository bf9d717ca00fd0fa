"""Fuzzing of the pure planning core at scale: N up to 2**40, up to 4096 ranks, 64
workers and batches of 4096, any resume position.

Nothing here enumerates an epoch: each example samples a few ranks, batches and workers
and checks them against what the plan promises (sizes, disjointness, the bijection onto
samples, the worker dealing, the consumed prefix and resume).  An N-sized array for
N = 2**40 would need 8 TiB, so these tests also show that planning never builds one.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from evenly.core.plan import EpochPlan
from tests.plans import make_plan

#: Largest set of positions a single check may build (keeps each example fast).
MAX_POSITIONS = 1 << 17


@st.composite
def plans(draw: st.DrawFn, max_step: int | None = None) -> EpochPlan:
    """Plans over tiny to huge N, with the resume position anywhere in [0, N]."""
    n = draw(
        st.one_of(
            st.integers(0, 64),
            st.integers(0, 10**6),
            st.integers(2**30, 2**40),
            st.integers(0, 2**40),
        )
    )
    world = draw(st.one_of(st.integers(1, 8), st.integers(1, 4096), st.just(4096)))
    if max_step is None:
        batch = draw(st.one_of(st.integers(1, 16), st.integers(1, 4096), st.just(4096)))
    else:
        batch = draw(st.integers(1, max(1, max_step // world)))
    step = world * batch
    start = draw(
        st.one_of(
            st.just(0),
            st.just(n),
            st.integers(0, n),
            # close to the end: the tail, padding and drop_last under a resume
            st.integers(max(0, n - 3 * step), n),
        )
    )
    return make_plan(
        num_samples=n,
        world_size=world,
        batch_size=batch,
        drop_last=draw(st.booleans()),
        shuffle=draw(st.booleans()),
        seed=draw(st.integers(0, 2**40)),
        epoch=draw(st.integers(0, 1000)),
        start=start,
    )


def some_ranks(data: st.DataObject, plan: EpochPlan) -> list[int]:
    picked = data.draw(st.lists(st.integers(0, plan.world_size - 1), max_size=3))
    return sorted({0, plan.world_size - 1, *picked})


def some_batches(data: st.DataObject, plan: EpochPlan) -> list[int]:
    last = plan.num_batches - 1
    if last < 0:
        return []
    picked = data.draw(st.lists(st.integers(0, last), max_size=3))
    return sorted({0, last, last // 2, *picked})


def expected_length(plan: EpochPlan, batch: int) -> int:
    return plan.batch_size if batch < plan.num_full_steps else plan.tail_per_rank


# ---- sizes ------------------------------------------------------------------------------
@given(plan=plans(), data=st.data())
@settings(max_examples=300, deadline=None)
def test_sizes_add_up_and_every_rank_has_num_batches_full_batches_but_the_last(
    plan: EpochPlan, data: st.DataObject
) -> None:
    n, world, size = plan.num_samples, plan.world_size, plan.batch_size
    remaining = n - plan.start
    assert plan.samples_per_rank * world == remaining - plan.num_dropped + plan.num_padded
    assert 0 <= plan.num_padded < world
    assert 0 <= plan.num_dropped < world * size
    if not plan.drop_last:
        assert plan.num_dropped == 0
    else:
        assert plan.num_padded == 0
    # batches: all full but at most the last, and they add up to samples_per_rank
    nb = plan.num_batches
    assert nb * size >= plan.samples_per_rank > (nb - 1) * size
    for rank in some_ranks(data, plan):
        for batch in some_batches(data, plan):
            got = plan.batch_positions(rank, batch).size
            assert got == (size if batch < nb - 1 else plan.samples_per_rank - (nb - 1) * size)
            assert 1 <= got <= size
            if plan.drop_last:
                assert got == size
        # exactly num_batches batches on every rank: one more does not exist
        for beyond in (nb, nb + 1, -1):
            try:
                plan.batch_positions(rank, beyond)
            except IndexError:
                pass
            else:
                raise AssertionError(f"rank {rank} has a batch {beyond} of {nb}")
    assert plan.end == n - plan.num_dropped


# ---- positions and samples ---------------------------------------------------------------
@given(plan=plans(), data=st.data())
@settings(max_examples=300, deadline=None)
def test_sampled_batches_are_disjoint_in_range_and_map_to_distinct_samples(
    plan: EpochPlan, data: st.DataObject
) -> None:
    n = plan.num_samples
    ranks, batches = some_ranks(data, plan), some_batches(data, plan)
    pairs = list(itertools.product(ranks, batches))
    pieces = [plan.batch_positions(r, b) for r, b in pairs]
    for (r, b), piece in zip(pairs, pieces, strict=True):
        assert piece.size == expected_length(plan, b), (r, b)
    pos = np.concatenate(pieces) if pieces else np.array([], dtype=np.int64)
    # virtual positions lie in [start, N + padding) and distinct (rank, batch) are disjoint
    if pos.size:
        assert int(pos.min()) >= plan.start
        assert int(pos.max()) < n + plan.num_padded
    assert np.unique(pos).size == pos.size
    # only the tail may hold padding positions
    for (_, b), piece in zip(pairs, pieces, strict=True):
        if b < plan.num_full_steps:
            assert int(piece.max()) < n
    # real positions are a bijection onto samples: distinct indices in [0, N)
    real = pos[pos < n]
    idx = plan.indices(real)
    assert idx.shape == real.shape
    assert np.unique(idx).size == idx.size
    if idx.size:
        assert int(idx.min()) >= 0 and int(idx.max()) < n
    if not plan.shuffle:
        assert np.array_equal(idx, real)
    # a padding position v >= N reads position (v - N) % N, the start of the order
    pads = pos[pos >= n]
    assert pads.size <= plan.num_padded
    if pads.size:
        assert np.array_equal(plan.indices(pads), plan.indices((pads - n) % n))


@given(plan=plans(max_step=MAX_POSITIONS // 4), data=st.data())
@settings(max_examples=60, deadline=None)
def test_each_step_covers_its_slice_of_the_order_exactly_once(
    plan: EpochPlan, data: st.DataObject
) -> None:
    """All ranks' batch ``s`` together are exactly the positions of global step ``s``."""
    world, step = plan.world_size, plan.world_size * plan.batch_size
    batches = some_batches(data, plan)
    sizes = np.cumsum([expected_length(plan, b) for b in batches])[:-1]
    # per rank, all the sampled batches in one call, then split batch by batch
    per_rank = [np.split(plan.batches_positions(r, batches), sizes) for r in range(world)]
    for i, batch in enumerate(batches):
        pos = np.concatenate([pieces[i] for pieces in per_rank])
        lo = plan.start + batch * step
        hi = lo + step if batch < plan.num_full_steps else plan.num_samples + plan.num_padded
        assert np.array_equal(np.sort(pos), np.arange(lo, hi))
    if plan.drop_last and plan.num_dropped:
        # the dropped remainder is the very end of the order, and nobody reads it
        assert plan.start + plan.num_batches * step == plan.num_samples - plan.num_dropped


# ---- workers ------------------------------------------------------------------------------
def read_window(
    plan: EpochPlan, rank: int, workers: int, worker: int, first: int, count: int, chunk: int
) -> list[list[int]]:
    """Up to ``count`` batches that worker reads from its ``first``-th batch on."""
    out: list[list[int]] = []
    for positions, length in plan.iter_worker_chunks(rank, workers, worker, chunk, first=first):
        assert length >= 1 and positions.size % length == 0
        flat = positions.tolist()
        out += [flat[i : i + length] for i in range(0, len(flat), length)]
        if len(out) >= count:
            return out[:count]
    return out


@given(
    plan=plans(),
    workers=st.integers(0, 64),
    chunk=st.one_of(st.integers(1, 64), st.integers(1, 8192)),
    data=st.data(),
)
@settings(max_examples=200, deadline=None)
def test_batch_b_goes_to_worker_b_mod_w_and_each_worker_yields_exactly_its_batches(
    plan: EpochPlan, workers: int, chunk: int, data: st.DataObject
) -> None:
    nb, w_count = plan.num_batches, max(workers, 1)
    for batch in some_batches(data, plan):
        owners = [w for w in range(w_count) if batch in plan.worker_batches(workers, w)]
        assert owners == [batch % w_count]
    rank = data.draw(st.sampled_from(some_ranks(data, plan)))
    picked = data.draw(st.lists(st.integers(0, w_count - 1), max_size=2))
    for worker in sorted({0, w_count - 1, *picked}):
        mine = plan.worker_batches(workers, worker)
        assert mine == range(worker, nb, w_count)
        window = max(1, min(4, MAX_POSITIONS // (8 * plan.batch_size)))
        # a window from an arbitrary batch of this worker's, and the last few to the end
        firsts = {0, max(0, len(mine) - window)}
        if len(mine):
            firsts.add(data.draw(st.integers(0, len(mine))))
        for first in sorted(firsts):
            got = read_window(plan, rank, workers, worker, first, window, chunk)
            want = mine[first : first + window]
            assert len(got) == len(want)
            for batch, read in zip(want, got, strict=True):
                assert read == plan.batch_positions(rank, batch).tolist()
        # reading from its last batch on yields exactly that batch, then stops
        tail = list(plan.iter_worker_chunks(rank, workers, worker, chunk, first=len(mine) - 1))
        if len(mine):
            ((positions, length),) = tail
            assert length == expected_length(plan, mine[-1])
            assert positions.tolist() == plan.batch_positions(rank, mine[-1]).tolist()
        assert list(plan.iter_worker_chunks(rank, workers, worker, chunk, first=len(mine))) == []


# ---- consumed prefix and resume ----------------------------------------------------------
@given(plan=plans(), data=st.data())
@settings(max_examples=200, deadline=None)
def test_consumed_after_is_monotone_and_a_resume_there_has_exactly_the_rest(
    plan: EpochPlan, data: st.DataObject
) -> None:
    nb, step = plan.num_batches, plan.world_size * plan.batch_size
    ks = sorted({0, max(0, nb - 1), nb, nb + 1, nb + 100, *some_batches(data, plan)})
    ks += sorted(data.draw(st.lists(st.integers(0, nb + 2), max_size=3)))
    ks = sorted(set(ks))
    consumed = [plan.consumed_after(k) for k in ks]
    assert consumed == sorted(consumed)
    assert plan.consumed_after(0) == plan.start
    for k, c in zip(ks, consumed, strict=True):
        if k < nb:
            assert c == plan.start + k * step
        else:
            assert c == plan.num_samples - plan.num_dropped == plan.end
        assert plan.start <= c <= plan.num_samples

        resumed = replace(plan, start=c)
        done = min(k, nb)
        assert resumed.remaining == plan.num_samples - c
        assert resumed.num_batches == nb - done
        if done < nb:
            assert resumed.samples_per_rank == plan.samples_per_rank - done * plan.batch_size
        else:
            assert resumed.samples_per_rank == 0
        assert resumed.end == plan.end
        if done < nb:
            assert resumed.num_padded == plan.num_padded
            assert resumed.num_dropped == plan.num_dropped
        else:
            assert resumed.num_padded == 0
        # what is left, per rank, is the original plan's batches k, k+1, ...
        rank = data.draw(st.integers(0, plan.world_size - 1))
        for j in some_batches(data, resumed):
            again = resumed.batch_positions(rank, j)
            assert np.array_equal(again, plan.batch_positions(rank, done + j))
            assert np.array_equal(resumed.indices(again), plan.indices(again))
