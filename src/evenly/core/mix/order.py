"""The order of a mixture's epoch: position -> global index (numpy only: no torch, no I/O).

Semantics
---------
A mixture of ``D`` sources gives source ``d`` exactly ``c_d`` of the epoch's
``S = sum(c)`` positions (:func:`~evenly.core.mix.apportion.mix_counts`).
Each source is an endless *stream* of its own passes; pass ``k`` is a keyed permutation
of the source (identity without shuffle) and epoch ``e`` takes the next ``c_d`` items of
the stream, from ``offsets[d]`` on (:func:`~evenly.core.mix.apportion.epoch_offsets`).
:class:`MixOrder` maps a position of the epoch to a global index (``start of source d +
sample index in d``).

The epoch is cut into *steps* of ``G`` positions (``G = world_size * batch_size``),
anchored at ``start`` (a resume may change ``G`` at a step boundary: earlier segments are
given as ``history``).  Step ``[lo, hi)`` holds ``F_d(hi) - F_d(lo)`` slots of source
``d``, where ``F(P)`` is the apportionment (see below); the slots are dealt to the positions of
the step by a bijection keyed by ``(seed, epoch, lo)``, so no rank is favoured.  Source
``d``'s slots of the step read stream items ``offsets[d] + F_d(lo) + 0, 1, ...``.  Hence
the items read before any step boundary ``P`` are exactly ``[0, F_d(P))`` of each
stream, every item of the epoch's window is read once, and a resume at ``P`` reads the
complement, whatever the new step.  "Once before twice" holds at step granularity: the
items of one step (consumed together by all ranks) are dealt in a keyed order.

The apportionment ``F`` and why it is exact at every step boundary: see
:mod:`evenly.core.mix.apportion`.

>>> from evenly.core.mix.apportion import mix_counts
>>> order = MixOrder([3, 2], mix_counts([3, 2]), (0, 0), names=["a", "b"], seed=0,
...                  epoch=0, shuffle=False, step=5)
>>> sorted(order(range(5)).tolist())
[0, 1, 2, 3, 4]
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from evenly.core.mix.apportion import Segmented
from evenly.core.permutation import as_int64, derive_keys, keyed_bijection, mix64

__all__ = ["MixOrder", "TooSmallStep"]

I64 = npt.NDArray[np.int64]
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


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
        changes: Sequence[tuple[int, Sequence[int]]] = (),
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
        self.changes = tuple((int(p), tuple(int(c) for c in cs)) for p, cs in changes)
        for p, _ in self.changes:
            if not 0 < p < self.num_samples:
                raise ValueError(f"a weight change at position {p} is outside the epoch")
            self._boundary(p)
        self._apportion = Segmented([(0, self.counts), *self.changes], self.hold)
        #: the epoch's count of each source (``counts`` unless the weights changed in it)
        self.totals = self._apportion.totals
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


class TooSmallStep:
    """The order of a pass whose step is below the epoch's ``hold``: it raises when read
    (not when planned, so that ``len(dataset)`` keeps working)."""

    def __init__(self, message: str) -> None:
        self.message = message

    @classmethod
    def of(cls, step: int, epoch: int, hold: int, *, started: bool) -> TooSmallStep:
        """The order of a pass dealt in steps of ``step`` below the epoch's ``hold``."""
        return cls(
            f"evenly.Mix: the global step (world_size x batch_size) is {step} but epoch "
            f"{epoch} was {'started' if started else 'set up'} with steps of at least {hold}"
            ": a mixture stays exact only if no step is smaller.  Resume at an epoch "
            f"boundary, keep world_size x batch_size >= {hold}, or build the Mix with "
            "min_step=<the smallest step> from the start (under a loader other than "
            "evenly.DataLoader the step is world_size)"
        )

    def __call__(self, positions: npt.ArrayLike) -> I64:
        raise ValueError(self.message)
