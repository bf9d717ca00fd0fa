"""The apportionment of a mixture: how many of the first ``P`` positions each source gets
(numpy only: no torch, no I/O).

A mixture of ``D`` sources gives source ``d`` exactly ``c_d`` of the epoch's
``S = sum(c)`` positions (:func:`mix_counts`: largest remainder of ``w_d / sum(w) * S``);
epoch ``e`` reads each source's stream from ``offsets[d]`` on (:func:`epoch_offsets`).
:class:`Apportionment` is ``F(P)``, the counts of each source among the first ``P``
positions, which :class:`evenly.core.mix.order.MixOrder` evaluates at step boundaries.

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
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import Any

import numpy as np
import numpy.typing as npt

from evenly.core.permutation import as_int64

__all__ = ["Apportionment", "Segmented", "check_weights", "epoch_offsets", "mix_counts"]

I64 = npt.NDArray[np.int64]
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


class Segmented:
    """An epoch's apportionment when the weights change inside it (``set_weights``).

    ``segments`` lists ``(start, counts)``: from position ``start`` on, the rest of the
    epoch (``sum(counts)`` positions) is apportioned by ``counts`` (the first segment
    starts at 0 with the epoch's counts).  ``F(P)`` for ``P`` in a segment is the counts
    reached at its start plus that segment's own :class:`Apportionment` of ``P - start``:
    each stream continues where the previous segment left it, and at every step boundary
    ``Q`` of a segment starting at ``P`` each source's count in ``[P, Q)`` is within the
    segment's bound of ``(Q - P) * counts_d / sum(counts)``.

    >>> f = Segmented([(0, (5, 5)), (4, (6, 0))], hold=2)
    >>> f(np.array([0, 2, 4, 6, 10])).tolist()
    [[0, 0], [1, 1], [2, 2], [4, 2], [8, 2]]
    >>> f.totals
    (8, 2)
    """

    def __init__(self, segments: Sequence[tuple[int, Sequence[int]]], hold: int) -> None:
        if not segments or int(segments[0][0]) != 0:
            raise ValueError(f"the first segment must start at position 0, got {segments}")
        self.starts = np.array([int(s) for s, _ in segments], dtype=np.int64)
        total = sum(int(c) for c in segments[0][1])
        for (start, counts), nxt in zip(segments, [*self.starts[1:].tolist(), total], strict=True):
            if sum(int(c) for c in counts) != total - int(start) or not start < nxt:
                raise ValueError(
                    f"a segment from position {start} must apportion the {total - int(start)} "
                    f"positions left of the epoch's {total}, and start before the next one "
                    f"({nxt}); got counts {tuple(counts)}"
                )
        self.parts = [Apportionment(c, hold) for _, c in segments]
        self.total = total
        base = [np.zeros(len(segments[0][1]), dtype=np.int64)]
        for d, part in enumerate(self.parts[:-1]):
            base.append(base[-1] + part([int(self.starts[d + 1] - self.starts[d])])[0])
        self._base = np.stack(base)
        #: per source, the largest of the segments' bounds
        self.bounds = tuple(max(b) for b in zip(*(p.bounds for p in self.parts), strict=True))
        #: the epoch's count of each source
        self.totals = tuple(int(x) for x in (self._base[-1] + self.parts[-1].counts))

    def __call__(self, positions: npt.ArrayLike) -> I64:
        """Counts of each source among the first ``P`` positions, shape ``(len(P), D)``."""
        P = as_int64(positions).reshape(-1)
        if len(self.parts) == 1:
            return self.parts[0](P)
        seg = np.searchsorted(self.starts, P, side="right") - 1
        out = self._base[seg].copy()
        for k, part in enumerate(self.parts):
            at = seg == k
            if at.any():
                out[at] += part(P[at] - self.starts[k])
        return out


def check_weights(names: Sequence[str], weights: Mapping[str, float]) -> dict[str, float]:
    """Validate a Mix's ``weights``: exactly its source ``names``, numbers >= 0."""
    if not isinstance(weights, Mapping):
        raise TypeError(
            f"evenly.Mix: weights must map source names to numbers, e.g. "
            f"{{{names[0]!r}: 0.7, ...}}; got {type(weights).__name__}"
        )
    unknown = [str(k) for k in weights if str(k) not in names]
    missing = [n for n in names if n not in weights]
    if unknown or missing:
        raise ValueError(
            f"evenly.Mix: weights must name exactly the sources {list(names)}; "
            + (f"unknown: {unknown} " if unknown else "")
            + (f"missing: {missing} (give weight 0 to leave one out)" if missing else "")
        )
    out = {}
    for name in names:
        w = weights[name]
        if isinstance(w, bool) or not isinstance(w, int | float | np.integer | np.floating):
            raise TypeError(f"evenly.Mix: weight of source {name!r} must be a number, got {w!r}")
        if not np.isfinite(w) or w < 0:
            raise ValueError(f"evenly.Mix: weight of source {name!r} must be >= 0, got {w}")
        out[name] = float(w)
    return out
