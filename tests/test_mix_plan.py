"""The pure planning core of mixtures (evenly.core.mix): exact counts, streams, prefix
exactness at global step boundaries, fair slots, resume under another step size."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from evenly.core.mix.apportion import Apportionment, epoch_offsets, mix_counts
from evenly.core.mix.order import MixOrder
from evenly.core.permutation import keyed_bijection


@st.composite
def mixtures(draw: st.DrawFn, max_sources: int = 5) -> tuple[list[int], tuple[int, ...]]:
    """Lengths (with a length-1 source and sources shorter than their share) and counts."""
    n = draw(st.integers(1, max_sources))
    lengths = draw(st.lists(st.integers(1, 25), min_size=n, max_size=n))
    if draw(st.booleans()):
        lengths[draw(st.integers(0, n - 1))] = 1
    weights = draw(st.lists(st.integers(0, 12), min_size=n, max_size=n))
    if sum(weights) == 0:
        weights[0] = 1
    total = draw(st.integers(1, 150))
    return lengths, mix_counts(lengths, weights, total)


def _order(lengths: list[int], counts: tuple[int, ...], epoch: int = 0, **kw: object) -> MixOrder:
    kw.setdefault("step", 1)
    return MixOrder(
        lengths,
        counts,
        epoch_offsets(counts, epoch),
        names=[f"src{d}" for d in range(len(lengths))],
        seed=3,
        epoch=epoch,
        shuffle=True,
        **kw,  # type: ignore[arg-type]
    )


def _boundaries(order: MixOrder) -> list[int]:
    out = []
    for i, (s, g) in enumerate(order.segments):
        end = order.segments[i + 1][0] if i + 1 < len(order.segments) else order.num_samples
        out += list(range(s, end, g))
    return [*out, order.num_samples]


def _check_boundaries(order: MixOrder) -> None:
    """Counts of each source before every step boundary, from the positions themselves."""
    src, _ = order.locate(np.arange(order.num_samples))
    counts, total = np.array(order.counts), order.num_samples
    for p in _boundaries(order):
        seen = np.bincount(src[:p], minlength=len(counts))
        assert seen.tolist() == list(order.counts_at(p))
        dev = np.abs(seen - p * counts / total)
        assert (dev <= np.array(order.bounds) + 1e-9).all(), (p, seen.tolist())


# ---- counts per epoch ------------------------------------------------------------------


@given(
    st.lists(st.integers(0, 1000), min_size=1, max_size=8).filter(any),
    st.integers(1, 10**6),
)
@settings(max_examples=200, deadline=None)
def test_counts_are_within_one_of_the_quota_and_sum_exactly(weights: list[int], total: int) -> None:
    counts = mix_counts([1] * len(weights), [w / 7 for w in weights], total)
    assert sum(counts) == total
    for w, c in zip(weights, counts, strict=True):
        assert abs(c - w / sum(weights) * total) < 1 + 1e-9


def test_counts_by_largest_remainder_example() -> None:
    # quotas 2.1, 2.1, 5.8: floors 2, 2, 5 and the one extra goes to the largest remainder
    assert mix_counts([9, 9, 9], [21, 21, 58], 10) == (2, 2, 6)
    # equal remainders: the lower index wins
    assert mix_counts([9, 9, 9], [1, 1, 1], 10) == (4, 3, 3)


@given(
    st.lists(st.integers(1, 20), min_size=1, max_size=5),
    st.integers(1, 12),
    st.integers(0, 3),
)
@settings(max_examples=100, deadline=None)
def test_default_mix_is_a_concatenation(lengths: list[int], step: int, epoch: int) -> None:
    counts = mix_counts(lengths)
    assert counts == tuple(lengths)
    order = _order(lengths, counts, epoch=epoch, step=step)
    indices = order(np.arange(sum(lengths)))
    assert sorted(indices.tolist()) == list(range(sum(lengths)))


# ---- (a) exact counts, (b) streams: once before twice ------------------------------------


@given(mixtures(), st.integers(1, 16), st.integers(1, 4))
@settings(max_examples=150, deadline=None)
def test_exact_counts_per_epoch_and_once_before_twice(
    mix: tuple[list[int], tuple[int, ...]], step: int, epochs: int
) -> None:
    lengths, counts = mix
    total = sum(counts)
    delivered: list[Counter[int]] = [Counter() for _ in lengths]
    for epoch in range(epochs):
        order = _order(lengths, counts, epoch=epoch, step=step)
        src, item = order.locate(np.arange(total))
        index = order(np.arange(total))
        assert np.bincount(src, minlength=len(counts)).tolist() == list(counts)
        base = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        for p in _boundaries(order)[1:]:
            lo = max(b for b in _boundaries(order) if b < p)
            for d in range(len(lengths)):
                mine = src[lo:p] == d
                # a step reads the next items of the stream, consecutive
                items = np.sort(item[lo:p][mine])
                start = epoch_offsets(counts, epoch)[d] + order.counts_at(lo)[d]
                assert items.tolist() == list(range(start, start + len(items)))
                delivered[d].update((index[lo:p][mine] - base[d]).tolist())
                # once before twice: after every step, counts differ by at most one
                if delivered[d]:
                    seen = [delivered[d][i] for i in range(lengths[d])]
                    assert max(seen) - min(seen) <= 1, (d, seen)


@given(st.integers(2, 40), st.integers(1, 5), st.integers(0, 2**32))
@settings(max_examples=60, deadline=None)
def test_each_pass_is_a_permutation_of_the_source(length: int, passes: int, seed: int) -> None:
    order = MixOrder(
        [length],
        (length * passes,),
        (0,),
        names=["only"],
        seed=seed,
        epoch=0,
        shuffle=True,
        step=1,
    )
    out = order(np.arange(length * passes)).reshape(passes, length)
    for row in out:
        assert sorted(row.tolist()) == list(range(length))
    if length >= 10 and passes >= 2:  # pass k is keyed by k: a new order each pass
        assert len({tuple(row.tolist()) for row in out}) == passes
    unshuffled = MixOrder(
        [length],
        (length * passes,),
        (0,),
        names=["only"],
        seed=seed,
        epoch=0,
        shuffle=False,
        step=1,
    )
    assert unshuffled(np.arange(length * passes)).tolist() == list(range(length)) * passes


def test_passes_are_keyed_by_source_name_not_position() -> None:
    a = MixOrder(
        [50, 50], (50, 50), (0, 0), names=["web", "code"], seed=0, epoch=0, shuffle=True, step=1
    )
    b = MixOrder(
        [50, 50], (50, 50), (0, 0), names=["code", "web"], seed=0, epoch=0, shuffle=True, step=1
    )
    sa, ia = a.locate(np.arange(100))
    sb, ib = b.locate(np.arange(100))
    # the same stream item of "web" is the same sample, wherever the source sits
    web_a = dict(zip(ia[sa == 0].tolist(), (a(np.arange(100))[sa == 0]).tolist(), strict=True))
    web_b = dict(zip(ib[sb == 1].tolist(), (b(np.arange(100))[sb == 1] - 50).tolist(), strict=True))
    assert web_a == web_b


# ---- (c) prefix exactness at every global step boundary ------------------------------------


@given(mixtures(max_sources=6), st.integers(1, 24))
@settings(max_examples=300, deadline=None)
def test_counts_within_one_at_every_step_boundary(
    mix: tuple[list[int], tuple[int, ...]], step: int
) -> None:
    lengths, counts = mix
    order = _order(lengths, counts, step=step)
    _check_boundaries(order)
    total = sum(counts)
    majors = [c * step >= total for c in counts]
    minors = sum(1 for c in counts if 0 < c * step < total)
    for d, bound in enumerate(order.bounds):
        if majors[d] or minors <= 1:
            assert bound == 1.0


@given(
    st.lists(st.integers(0, 40), min_size=1, max_size=8),
    st.integers(1, 30),
    st.data(),
)
@settings(max_examples=300, deadline=None)
def test_apportionment_is_monotone_and_exact_at_any_point(
    counts: list[int], hold: int, data: st.DataObject
) -> None:
    if sum(counts) == 0:
        counts[0] = 1
    total = sum(counts)
    f = Apportionment(counts, hold)
    points = np.arange(total + 1)
    table = f(points)
    assert table[0].tolist() == [0] * len(counts)
    assert table[-1].tolist() == counts
    assert (table.sum(axis=1) == points).all()
    assert (table <= np.array(counts)).all()
    dev = np.abs(table - points[:, None] * np.array(counts) / total)
    assert (dev <= np.array(f.bounds) + 1e-9).all()
    # monotone between any two points at least `hold` apart, and into the epoch's end
    p = data.draw(st.integers(0, total))
    later = [q for q in range(p + hold, total + 1)] + [total]
    assert (table[later] >= table[p]).all()


def test_many_minor_sources_get_the_reported_bound() -> None:
    # 12 sources of 1 slot per 3 steps each: all minor; the bound is reported, and held
    counts, hold = [10] * 12, 4
    f = Apportionment(counts, hold)
    assert all(1.0 < b < 2.0 for b in f.bounds)
    points = np.arange(0, 121, hold)
    dev = np.abs(f(points) - points[:, None] * 10 / 120)
    assert (dev <= np.array(f.bounds)).all()


def test_minor_sources_split_from_major_groups_stay_within_one_and_a_half() -> None:
    # 4 sources of 0.75 slots per step: pairs of them are major groups, split exactly
    # from the whole; each source loses only its share of its pair: 1 + 6/12
    f = Apportionment([6, 6, 6, 6], hold=3)
    assert f.bounds == (1.5, 1.5, 1.5, 1.5)
    points = np.arange(0, 25, 3)
    assert (np.abs(f(points) - points[:, None] / 4) <= 1.5).all()


def test_large_epochs_use_exact_integer_arithmetic() -> None:
    counts = [3_000_000_001, 1_999_999_999, 7]  # S = 5e9: P * c_d overflows int64
    f = Apportionment(counts, hold=4096)
    points = np.array([0, 1, 4096, 2_500_000_000, 4_999_999_999, 5_000_000_007])
    table = f(points)
    assert table[-1].tolist() == counts
    assert table.sum(axis=1).tolist() == points.tolist()
    for row, p in zip(table.tolist(), points.tolist(), strict=True):
        for c, got in zip(counts, row, strict=True):
            exact = p * c // sum(counts)
            assert exact <= got <= exact + 1


# ---- (d) no rank favoured inside a step; (e) independent of who asks --------------------


@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_no_rank_is_favoured_with_equal_weights(layout: str) -> None:
    # batch 1, 2 ranks: each step holds one sample of each source; rank r takes slot r
    total = 20_000
    order = _order([10_000, 10_000], (10_000, 10_000), step=2)
    src, _ = order.locate(np.arange(total))
    rank0 = src[0::2] if layout == "contiguous" else src[: total // 2]
    share = float(np.mean(rank0 == 0))
    assert abs(share - 0.5) < 0.03  # binomial sd is 0.005 over 10_000 steps
    if layout == "contiguous":
        for d in (0, 1):  # per step both sources, so rank 1 gets the complement
            assert int(np.sum(src[1::2] == d)) == 10_000 - int(np.sum(rank0 == d))


@given(mixtures(), st.integers(1, 12), st.integers(0, 2**31))
@settings(max_examples=80, deadline=None)
def test_a_position_maps_the_same_whoever_asks(
    mix: tuple[list[int], tuple[int, ...]], step: int, shuffle_seed: int
) -> None:
    lengths, counts = mix
    total = sum(counts)
    whole = _order(lengths, counts, step=step)(np.arange(total))
    rng = np.random.default_rng(shuffle_seed)
    asked = rng.permutation(total)
    fresh = _order(lengths, counts, step=step)  # another process: a new object
    for part in np.array_split(asked, 1 + total // 7):
        assert fresh(part).tolist() == whole[part].tolist()
    for p in asked[:5].tolist():
        assert int(fresh(p)) == int(whole[p])


def test_pinned_order() -> None:
    """Cross-version determinism: this exact order must not change silently."""
    order = _order([5, 3, 1], mix_counts([5, 3, 1], [1, 1, 1], 9), step=3)
    assert order(np.arange(9)).tolist() == PINNED


PINNED = [3, 5, 8, 4, 8, 7, 1, 8, 6]


# ---- resume under another step size --------------------------------------------------------


@given(mixtures(), st.integers(1, 10), st.integers(1, 10), st.data())
@settings(max_examples=200, deadline=None)
def test_resume_at_a_step_boundary_with_another_step(
    mix: tuple[list[int], tuple[int, ...]], old: int, new: int, data: st.DataObject
) -> None:
    lengths, counts = mix
    total = sum(counts)
    hold = min(old, new)
    before = _order(lengths, counts, step=old, hold=hold)
    start = data.draw(st.sampled_from(_boundaries(before)))
    after = _order(lengths, counts, step=new, start=start, history=[(0, old)], hold=hold)
    src_b, item_b = before.locate(np.arange(total))
    src_a, item_a = after.locate(np.arange(total))
    # positions before start map exactly as they did
    assert after(np.arange(start)).tolist() == before(np.arange(start)).tolist()
    # the stream items read after start are the complement of those read before
    for d in range(len(counts)):
        used = sorted(item_a[:start][src_a[:start] == d].tolist())
        rest = sorted(item_a[start:][src_a[start:] == d].tolist())
        assert sorted(used + rest) == list(range(counts[d]))
        assert used == sorted(item_b[:start][src_b[:start] == d].tolist())
    assert after.offsets_at(start) == before.offsets_at(start)
    _check_boundaries(after)


def test_resume_needs_a_step_boundary_and_a_step_not_below_hold() -> None:
    with pytest.raises(ValueError, match="position 5, which is not a step boundary"):
        _order([20], (20,), step=4, start=5, history=[(0, 4)])
    with pytest.raises(ValueError, match="step 2 is smaller than hold=4"):
        _order([20], (20,), step=2, start=8, history=[(0, 4)])
    order = _order([20], (20,), step=4)
    with pytest.raises(ValueError, match="position 6 is not a global step boundary"):
        order.offsets_at(6)


# ---- stream offsets: epochs, checkpoints, weight change at an epoch boundary --------------


@given(mixtures(), mixtures(), st.integers(0, 3), st.integers(1, 3))
@settings(max_examples=100, deadline=None)
def test_weight_change_at_an_epoch_boundary_continues_each_stream(
    first: tuple[list[int], tuple[int, ...]],
    second: tuple[list[int], tuple[int, ...]],
    change_at: int,
    later: int,
) -> None:
    lengths, counts = first
    n = len(lengths)
    new_counts = mix_counts(
        lengths, [c + 1 for c in second[1][:n]] + [1] * (n - len(second[1])), sum(second[1])
    )
    used: list[list[int]] = [[] for _ in lengths]
    for epoch in range(change_at):
        order = _order(lengths, counts, epoch=epoch, step=3)
        src, item = order.locate(np.arange(order.num_samples))
        for d in range(n):
            used[d] += item[src == d].tolist()
    end = (
        _order(lengths, counts, epoch=change_at - 1, step=3).offsets_at(sum(counts))
        if change_at
        else (0,) * n
    )
    assert end == epoch_offsets(counts, change_at)
    for epoch in range(change_at, change_at + later):
        offsets = epoch_offsets(new_counts, epoch, fixed=end, fixed_epoch=change_at)
        order = MixOrder(
            lengths,
            new_counts,
            offsets,
            names=[f"src{d}" for d in range(n)],
            seed=3,
            epoch=epoch,
            shuffle=True,
            step=3,
        )
        src, item = order.locate(np.arange(order.num_samples))
        for d in range(n):
            used[d] += item[src == d].tolist()
    for d in range(n):  # every stream read in order, no item skipped or read twice
        assert sorted(used[d]) == list(range(len(used[d])))


def test_replaying_an_epoch_before_a_fixed_state_is_an_error() -> None:
    with pytest.raises(ValueError, match="epoch 1 comes before epoch 2"):
        epoch_offsets([3, 4], 1, fixed=(6, 8), fixed_epoch=2)


# ---- bad input ----------------------------------------------------------------------------


def test_bad_mixtures_raise_clear_errors() -> None:
    with pytest.raises(ValueError, match="source 'code' is empty but its weight gives it 3"):
        mix_counts([5, 0], [1, 1], 6, names=["web", "code"])
    with pytest.raises(ValueError, match="weight of source 'web' must be >= 0"):
        mix_counts([5, 5], [-1, 1], 6, names=["web", "code"])
    with pytest.raises(ValueError, match="samples_per_epoch must be >= 1"):
        mix_counts([5], None, 0)
    with pytest.raises(ValueError, match="got 1 weights for 2 sources"):
        mix_counts([5, 5], [1])
    with pytest.raises(IndexError, match=r"positions must lie in \[0, 10\)"):
        _order([10], (10,))(np.array([10]))


@given(st.integers(1, 3000), st.integers(0, 2**64 - 1))
@settings(max_examples=100, deadline=None)
def test_keyed_bijection_is_a_bijection(size: int, key: int) -> None:
    keys = np.full(size, key, dtype=np.uint64)
    out = keyed_bijection(np.arange(size), np.full(size, size), keys)
    assert sorted(out.tolist()) == list(range(size))
