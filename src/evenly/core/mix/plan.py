"""Mixtures: the pure planning core of ``evenly.Mix`` (numpy only: no torch, no I/O).

Semantics
---------
A mixture of ``D`` sources gives source ``d`` exactly ``c_d`` of the epoch's
``S = sum(c)`` positions (:func:`mix_counts`: largest remainder of ``w_d / sum(w) * S``).
Each source is an endless *stream* of its own passes; pass ``k`` is a keyed permutation
of the source (identity without shuffle) and epoch ``e`` takes the next ``c_d`` items of
the stream, from ``offsets[d]`` on (:func:`epoch_offsets`).  :class:`MixOrder` maps a
position of the epoch to a global index (``start of source d + sample index in d``).

The epoch is cut into *steps* of ``G`` positions (``G = world_size * batch_size``),
anchored at ``start`` (a resume may change ``G`` at a step boundary: earlier segments are
given as ``history``).  Step ``[lo, hi)`` holds ``F_d(hi) - F_d(lo)`` slots of source
``d``, where ``F(P)`` is the apportionment below; the slots are dealt to the positions of
the step by a bijection keyed by ``(seed, epoch, lo)``, so no rank is favoured.  Source
``d``'s slots of the step read stream items ``offsets[d] + F_d(lo) + 0, 1, ...``.  Hence
the items read before any step boundary ``P`` are exactly ``[0, F_d(P))`` of each
stream, every item of the epoch's window is read once, and a resume at ``P`` reads the
complement, whatever the new step.  "Once before twice" holds at step granularity: the
items of one step (consumed together by all ranks) are dealt in a keyed order.

The apportionment ``F`` and why it is exact
-------------------------------------------
Let ``q_d(P) = P * c_d / S`` and ``H`` (``hold``) be a lower bound of every step size.
A source is *major* if ``c_d * H >= S`` (at least one slot per step), else *minor*.
``F`` is evaluated directly at any ``P`` in O(D):

1. The root splits ``P`` among the majors and one pooled group ``T`` of all minors.
   Each child gets ``floor(q)`` plus one extra for the ``E = P - sum(floor(q))`` largest
   remainders (ties: lower index); if ``T`` is itself minor it keeps ``floor(q_T)`` and
   the extras, ``E < #majors + 1``, go to majors only.  So every child has
   ``F in {floor(q), floor(q) + 1}``: ``|F - q| <= 1``, ``sum(F) = P``.  Monotone: if
   ``P' - P >= H``, a major's quota grows by ``>= 1``, so
   ``F(P') >= floor(q(P')) >= floor(q(P)) + 1 >= F(P)``; ``floor(q_T)`` is monotone.
2. Two or more minors share ``F_T`` down a Huffman tree.  A node ``x`` whose count is
   exact (as in 1) and whose children ``y, z`` are both major splits by the same largest
   remainder rule: ``floor(q_y) + floor(q_z) in {floor(q_x) - 1, floor(q_x)}`` gives
   ``0 <= E <= 2`` extras, so ``y, z`` are exact and monotone.  Any other split is
   ``F_y = floor(F_x * c_y / c_x)``, ``F_z = F_x - F_y``: nondecreasing in ``F_x``, with
   ``|F_y - q_y| < 1 + (c_y / c_x) * bound_x`` (:attr:`Apportionment.bounds`).
3. ``F(0) = 0``, ``F(S) = c`` and ``F(P) <= c`` for ``P <= S``, so the epoch's last,
   shorter step never gets a negative count.

Guarantee: at every step boundary ``P`` (of every segment) ``F`` is nondecreasing and
``|F_d(P) - P * c_d / S| <= bounds[d]``; ``bounds[d] == 1`` for every major source and
whenever at most one source is minor.  Only two or more sources with fewer than one
slot per ``hold`` positions get a bound above 1 (``< 1 + sum of share ratios`` up the
tree, reported per source).

>>> order = MixOrder([3, 2], mix_counts([3, 2]), (0, 0), names=["a", "b"], seed=0,
...                  epoch=0, shuffle=False, step=5)
>>> sorted(order(range(5)).tolist())
[0, 1, 2, 3, 4]
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

import numpy as np
import numpy.typing as npt

from evenly.core.permutation import as_int64, derive_keys, keyed_bijection, mix64

__all__ = ["Apportionment", "MixOrder", "epoch_offsets", "mix_counts"]

I64 = npt.NDArray[np.int64]
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_INT64_SAFE = 3_037_000_499  # floor(sqrt(2**63 - 1)): P * c_d fits in int64 below it


def _name(names: Sequence[str] | None, d: int) -> str:
    return repr(names[d]) if names is not None else f"#{d}"


def mix_counts(
    lengths: Sequence[int],
    weights: Sequence[float] | None = None,
    samples_per_epoch: int | None = None,
    *,
    names: Sequence[str] | None = None,
) -> tuple[int, ...]:
    """Samples per epoch of each source: ``w_d / sum(w) * S`` by largest remainder.

    Defaults: weights proportional to lengths, ``S = sum(lengths)`` (a concatenation).

    >>> mix_counts([100, 50, 1], weights=[0.7, 0.2, 0.1], samples_per_epoch=10)
    (7, 2, 1)
    >>> mix_counts([5, 3])
    (5, 3)
    """
    lens = [int(n) for n in lengths]
    if not lens or any(n < 0 for n in lens):
        raise ValueError(f"a mixture needs one or more sources of length >= 0, got {lens}")
    total = sum(lens) if samples_per_epoch is None else int(samples_per_epoch)
    if total < 1:
        raise ValueError(f"samples_per_epoch must be >= 1, got {total}")
    ws = [Fraction(n) for n in lens] if weights is None else [Fraction(w) for w in weights]
    if len(ws) != len(lens):
        raise ValueError(f"got {len(ws)} weights for {len(lens)} sources")
    for d, w in enumerate(ws):
        if w < 0:
            raise ValueError(f"weight of source {_name(names, d)} must be >= 0, got {w}")
    if sum(ws) <= 0:
        raise ValueError("the weights must not all be 0")
    quotas = [w / sum(ws) * total for w in ws]
    counts = [int(q) for q in quotas]
    by_remainder = sorted(range(len(ws)), key=lambda d: (-(quotas[d] - counts[d]), d))
    for d in by_remainder[: total - sum(counts)]:
        counts[d] += 1
    for d, (n, c) in enumerate(zip(lens, counts, strict=True)):
        if n == 0 and c > 0:
            raise ValueError(
                f"source {_name(names, d)} is empty but its weight gives it {c} samples "
                "per epoch: give it weight 0 or leave it out"
            )
    return tuple(counts)


def epoch_offsets(
    counts: Sequence[int],
    epoch: int,
    *,
    fixed: Sequence[int] | None = None,
    fixed_epoch: int = 0,
) -> tuple[int, ...]:
    """Each source's stream offset at the start of ``epoch``.

    ``epoch * c_d`` by default; after a loaded state fixed the offsets at ``fixed_epoch``
    (e.g. a weight change at an epoch boundary: new counts, same offsets), epochs after
    it continue from there.

    >>> epoch_offsets([7, 3], 2)
    (14, 6)
    >>> epoch_offsets([5, 5], 4, fixed=(14, 6), fixed_epoch=2)
    (24, 16)
    """
    if fixed is None:
        fixed, fixed_epoch = [0] * len(counts), 0
    if len(fixed) != len(counts):
        raise ValueError(f"got {len(fixed)} stream offsets for {len(counts)} sources")
    if epoch < fixed_epoch:
        raise ValueError(
            f"epoch {epoch} comes before epoch {fixed_epoch}, where a loaded state fixed "
            "the streams: it cannot be replayed; start from a state of that epoch or earlier"
        )
    pairs = zip(fixed, counts, strict=True)
    return tuple(int(o) + (epoch - fixed_epoch) * int(c) for o, c in pairs)


class Apportionment:
    """``F(P)``: how many of the first ``P`` positions each source gets (see the module).

    >>> f = Apportionment([6, 3, 1], hold=4)
    >>> f(np.array([0, 4, 8, 10])).tolist()
    [[0, 0, 0], [3, 1, 0], [5, 3, 0], [6, 3, 1]]
    >>> f.bounds
    (1.0, 1.0, 1.0)
    >>> [round(b, 2) for b in Apportionment([7, 2, 1], hold=4).bounds]  # two minors
    [1.0, 1.67, 1.33]
    """

    def __init__(self, counts: Sequence[int], hold: int) -> None:
        self.counts = tuple(int(c) for c in counts)
        self.total = sum(self.counts)
        if self.total < 1 or min(self.counts) < 0 or hold < 1:
            raise ValueError(f"need counts >= 0 summing to >= 1 and hold >= 1, got {counts}")
        self.hold = int(hold)
        self._dtype: Any = np.int64 if self.total <= _INT64_SAFE else object
        S, H = self.total, self.hold
        majors = [d for d, c in enumerate(self.counts) if c * H >= S]
        minors = [d for d, c in enumerate(self.counts) if 0 < c * H < S]
        # tree nodes: weight, children (or None), source (or -1); leaves of minors first
        self._w = [self.counts[d] for d in minors]
        self._kids: list[tuple[int, int] | None] = [None] * len(minors)
        self._src = list(minors)
        heap = [(w, i, i) for i, w in enumerate(self._w)]
        heapq.heapify(heap)
        while len(heap) > 1:
            (wa, _, a), (wb, _, b) = heapq.heappop(heap), heapq.heappop(heap)
            self._w.append(wa + wb)
            self._kids.append((a, b))
            self._src.append(-1)
            heapq.heappush(heap, (wa + wb, len(self._w) - 1, len(self._w) - 1))
        self._tau = len(self._w) - 1 if minors else -1
        self._tau_major = bool(minors) and self._w[self._tau] * H >= S
        self._root_w = np.array(
            [self.counts[d] for d in majors] + ([self._w[self._tau]] if self._tau_major else []),
            dtype=self._dtype,
        )
        self._majors = np.array(majors, dtype=np.int64)
        # splits top-down (parents were created after their children) and the bounds
        exact = {self._tau: True}
        bound = {self._tau: 1.0}
        self._splits: list[tuple[int, int, int, bool]] = []
        for x in range(len(self._w) - 1, -1, -1):
            kids = self._kids[x]
            if kids is None:
                continue
            a, b = kids
            ok = exact[x] and self._w[a] * H >= S and self._w[b] * H >= S
            self._splits.append((x, a, b, ok))
            for y in (a, b):
                exact[y] = ok
                bound[y] = 1.0 if ok else 1.0 + self._w[y] / self._w[x] * bound[x]
        bounds = [1.0] * len(self.counts)
        for node, d in enumerate(self._src):
            if d >= 0:
                bounds[d] = bound[node]
        #: per source: ``|F_d(P) - P * c_d / S| <= bounds[d]`` at every step boundary.
        self.bounds = tuple(bounds)

    def __call__(self, positions: npt.ArrayLike) -> I64:
        """Counts of each source among the first ``P`` positions, shape ``(len(P), D)``."""
        P = as_int64(positions).reshape(-1).astype(self._dtype)
        S = self.total
        out = np.zeros((P.size, len(self.counts)), dtype=self._dtype)
        node: dict[int, Any] = {}
        prod = P[:, None] * self._root_w[None, :]
        floors, rems = prod // S, prod % S  # np.divmod has no object (big S) loop
        extras = P - floors.sum(axis=1)
        if self._tau >= 0 and not self._tau_major:
            node[self._tau] = P * self._w[self._tau] // S
            extras = extras - node[self._tau]
        if floors.shape[1]:
            # unique keys: remainder first, then the lower index; the `extras` largest win
            width = floors.shape[1]
            key = rems * width + np.arange(width - 1, -1, -1)
            ranked = np.sort(key, axis=1)
            at = np.clip((width - extras).astype(np.int64), 0, width - 1)
            cut = np.take_along_axis(ranked, at[:, None], axis=1)
            kids = floors + ((key >= cut) & (extras > 0)[:, None])
            out[:, self._majors] = kids[:, : self._majors.size]
            if self._tau_major:
                node[self._tau] = kids[:, -1]
        for x, a, b, ok in self._splits:
            fx = node[x]
            if ok:
                fa, ra = P * self._w[a] // S, P * self._w[a] % S
                fb, rb = P * self._w[b] // S, P * self._w[b] % S
                left = fx - fa - fb  # 0, 1 or 2 extras (module docstring, step 2)
                node[a] = fa + ((left == 2) | ((left == 1) & (ra >= rb)))
            else:
                node[a] = fx * self._w[a] // self._w[x]
            node[b] = fx - node[a]
        for n, d in enumerate(self._src):
            if d >= 0:
                out[:, d] = node[n]
        return out.astype(np.int64)


class MixOrder:
    """One epoch's mixture order: position -> global index into the concatenated sources.

    ``offsets[d]`` is source ``d``'s stream offset at the epoch start
    (:func:`epoch_offsets`); ``step`` is the global step ``G`` (world size x batch size),
    anchored at ``start``; ``history`` lists the ``(start, step)`` segments that consumed
    the positions before ``start`` (first at 0; default: ``step`` from 0 on).  ``hold``
    must be <= every step the epoch is ever dealt with (default: the first segment's
    step), and the same for every segment.  Memory is O(number of sources).

    >>> order = MixOrder([4, 4], (4, 4), (0, 0), names=["a", "b"], seed=0, epoch=0,
    ...                  shuffle=True, step=2)
    >>> [int(i) // 4 for i in order(range(8))].count(0)
    4
    >>> order.offsets_at(4)
    (2, 2)
    """

    def __init__(
        self,
        lengths: Sequence[int],
        counts: Sequence[int],
        offsets: Sequence[int],
        *,
        names: Sequence[str],
        seed: int,
        epoch: int,
        shuffle: bool,
        step: int,
        start: int = 0,
        history: Sequence[tuple[int, int]] = (),
        hold: int | None = None,
    ) -> None:
        self.names = tuple(str(n) for n in names)
        self.lengths = np.array([int(n) for n in lengths], dtype=np.int64)
        self.counts = tuple(int(c) for c in counts)
        self.offsets = tuple(int(o) for o in offsets)
        if not len(self.names) == self.lengths.size == len(self.counts) == len(self.offsets):
            raise ValueError("names, lengths, counts and offsets must have one entry per source")
        for d, (n, c, o) in enumerate(
            zip(self.lengths.tolist(), self.counts, self.offsets, strict=True)
        ):
            if c < 0 or o < 0 or (c > 0 and n < 1):
                raise ValueError(
                    f"source {self.names[d]!r}: length {n}, count {c}, offset {o}: counts "
                    "and offsets must be >= 0 and a source with a count must not be empty"
                )
        self.num_samples = sum(self.counts)
        self.seed, self.epoch, self.shuffle = int(seed), int(epoch), bool(shuffle)
        segments = [(int(s), int(g)) for s, g in history] + [(int(start), int(step))]
        if not history and start > 0:
            segments.insert(0, (0, int(step)))
        self.hold = segments[0][1] if hold is None else int(hold)
        self._check_segments(segments)
        self.segments = tuple(segments)
        self._starts = np.array([s for s, _ in segments], dtype=np.int64)
        self._steps = np.array([g for _, g in segments], dtype=np.int64)
        self._ends = np.append(self._starts[1:], self.num_samples)
        self._apportion = Apportionment(self.counts, self.hold)
        self.bounds = self._apportion.bounds
        self._base = np.concatenate([[0], np.cumsum(self.lengths)[:-1]]).astype(np.int64)
        (self._slot_key,) = derive_keys("mix-slot", self.seed, self.epoch, 1)
        self._pass_keys = np.array(
            [derive_keys(f"mix-pass/{len(n)}:{n}", self.seed, 0, 1)[0] for n in self.names],
            dtype=np.uint64,
        )

    def _check_segments(self, segments: list[tuple[int, int]]) -> None:
        if segments[0][0] != 0:
            raise ValueError(f"history must start at position 0, got {segments[0]}")
        ends = [s for s, _ in segments[1:]] + [self.num_samples]
        for (s0, g0), s1 in zip(segments, ends, strict=True):
            if g0 < self.hold:
                raise ValueError(
                    f"step {g0} is smaller than hold={self.hold}: build every order of the "
                    "epoch with a hold <= the smallest step it will be dealt with "
                    "(hold=batch_size allows any world size)"
                )
            if not s0 <= s1 <= self.num_samples or (s1 < self.num_samples and (s1 - s0) % g0):
                raise ValueError(
                    f"a segment starts at position {s1}, which is not a step boundary of the "
                    f"steps of {g0} from position {s0} (epoch of {self.num_samples} samples): "
                    "resume at a global step boundary, and list the earlier (start, step) "
                    "segments in history"
                )

    def __len__(self) -> int:
        return self.num_samples

    def __call__(self, positions: npt.ArrayLike) -> I64:
        """Global indices (``start of source d + sample index in d``) of ``positions``."""
        pos = as_int64(positions)
        src, item = self.locate(pos.reshape(-1))
        return (self._base[src] + self._samples(src, item)).reshape(pos.shape)

    def locate(self, positions: npt.ArrayLike) -> tuple[I64, I64]:
        """``(source, stream item)`` of each position: item ``i`` of source ``d`` is
        sample ``perm_{d, i // len_d}(i % len_d)`` of pass ``i // len_d``."""
        pos = as_int64(positions).reshape(-1)
        if pos.size and (int(pos.min()) < 0 or int(pos.max()) >= self.num_samples):
            raise IndexError(f"positions must lie in [0, {self.num_samples})")
        seg = np.searchsorted(self._starts, pos, side="right") - 1
        first, step = self._starts[seg], self._steps[seg]
        lo = first + (pos - first) // step * step
        hi = np.minimum(lo + step, self._ends[seg])
        ulo, at, inv = np.unique(lo, return_index=True, return_inverse=True)
        inv = inv.reshape(-1)
        bounds, where = np.unique(np.concatenate([ulo, hi[at]]), return_inverse=True)
        f = self._apportion(bounds)[where.reshape(-1)]  # consecutive steps share a boundary
        f_lo = f[: ulo.size]
        have = f[ulo.size :] - f_lo
        cum = np.cumsum(have, axis=1)
        keys = mix64(lo.astype(np.uint64) * _GOLDEN ^ np.uint64(self._slot_key))
        slot = keyed_bijection(pos - lo, hi - lo, keys)
        width = int((hi - lo).max(initial=0)) + 1
        rows = np.arange(ulo.size, dtype=np.int64) * width
        ndim = len(self.counts)
        src = np.searchsorted((cum + rows[:, None]).ravel(), slot + rows[inv], side="right")
        src = src - inv * ndim
        rank = slot - cum[inv, src] + have[inv, src]
        item = np.asarray(self.offsets, dtype=np.int64)[src] + f_lo[inv, src] + rank
        return src.astype(np.int64), item

    def _samples(self, src: I64, item: I64) -> I64:
        lens = self.lengths[src]
        passes, within = np.divmod(item, lens)
        if not self.shuffle:
            return within
        keys = mix64(self._pass_keys[src] ^ mix64(passes.astype(np.uint64) * _GOLDEN))
        return keyed_bijection(within, lens, keys)

    def _boundary(self, position: int) -> int:
        p = int(position)
        seg = int(np.searchsorted(self._starts, p, side="right")) - 1
        s, g = self.segments[seg]
        if not 0 <= p <= self.num_samples or (p < self.num_samples and (p - s) % g):
            raise ValueError(
                f"position {p} is not a global step boundary (steps of {g} from {s}, epoch "
                f"of {self.num_samples}): a mixture's streams are exact at step boundaries, "
                "checkpoint there"
            )
        return p

    def counts_at(self, position: int) -> tuple[int, ...]:
        """Positions of each source among the first ``position`` (a step boundary)."""
        return tuple(self._apportion([self._boundary(position)])[0].tolist())

    def offsets_at(self, position: int) -> tuple[int, ...]:
        """Each stream's offset after the first ``position`` positions (a step boundary):
        what a checkpoint records; the end of the epoch gives the next epoch's offsets."""
        used = self.counts_at(position)
        return tuple(o + u for o, u in zip(self.offsets, used, strict=True))
