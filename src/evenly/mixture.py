"""``evenly.Mix``: weighted sources with exact proportions, each source an endless stream of
its own passes (every sample once before any twice), exact elastic resume, and a weight
change at an epoch boundary that continues every stream where it stopped.

This module is the source object ``evenly.Dataset`` reads (indices, checkpoints, stream
offsets); the planning math lives in :mod:`evenly.core.mix.plan`.  No torch, no I/O of its own.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from evenly.core.mix.apportion import epoch_offsets, mix_counts
from evenly.core.mix.order import MixOrder
from evenly.errors import StateError, check_int

__all__ = ["Mix"]

I64 = npt.NDArray[np.int64]
#: Orders remembered per epoch (for a checkpoint's step history): a few per process.
_REMEMBERED = 4


class _TooSmallStep:
    """The order of a pass whose step is below the epoch's ``hold``: it raises when read
    (not when planned, so that ``len(dataset)`` keeps working)."""

    def __init__(self, message: str) -> None:
        self.message = message

    def __call__(self, positions: npt.ArrayLike) -> I64:
        raise ValueError(self.message)


class Mix:
    """Sources mixed by weight: each epoch takes exactly ``c_d`` samples of source ``d``.

    ``c_d = w_d / sum(w) * samples_per_epoch`` rounded by largest remainder.  Each source
    is an endless stream of its own passes (pass ``k``: a permutation keyed by the seed,
    the source name and ``k``; the identity without shuffle); epoch ``e`` takes the next
    ``c_d`` items of each stream.  After every global step (``world_size * batch_size``
    positions) each source has contributed within ``bounds`` (1 unless two or more
    sources get less than one slot per step) of its share.  With neither ``weights`` nor
    ``samples_per_epoch`` a Mix is a concatenation: every sample once per epoch.

    >>> import evenly
    >>> from evenly import Mix
    >>> mix = Mix({"web": list(range(100)), "code": list(range(1000, 1010))},
    ...           weights={"web": 0.7, "code": 0.3}, samples_per_epoch=20)
    >>> len(mix), mix.counts
    (20, {'web': 14, 'code': 6})
    >>> loader = evenly.DataLoader(evenly.Dataset(mix, shuffle=True, seed=0), batch_size=5)
    >>> epoch = [int(x) for batch in loader for x in batch]
    >>> sum(x < 1000 for x in epoch), sum(x >= 1000 for x in epoch)
    (14, 6)

    Args:
        sources: name -> any sized indexable (a list, numpy array, map-style torch
            Dataset, an evenly file source).  ``__getitems__`` and ``prefetch`` of a
            source are used when it has them.
        weights: name -> weight >= 0 (default: proportional to the lengths).  Proportions
            are by samples, not tokens.
        samples_per_epoch: the epoch length (default: the sum of the lengths).
        min_step: the smallest global step (``world_size * batch_size``) this run will
            ever use, resumes included.  Default: each epoch's first step, the tightest
            bound; a mid-epoch resume may then not use a smaller step (fewer ranks or a
            smaller batch): it raises, naming this setting.  ``min_step=batch_size``
            allows a resume onto any world size, at the cost of a weaker bound for
            sources with less than one slot per ``min_step`` positions.

    The index space is the concatenation of the sources (``mix[i]``, ``0 <= i <
    sum of lengths``), which may be longer or shorter than ``len(mix)``.
    """

    def __init__(
        self,
        sources: Mapping[str, Any],
        weights: Mapping[str, float] | None = None,
        samples_per_epoch: int | None = None,
        *,
        min_step: int | None = None,
    ) -> None:
        if not isinstance(sources, Mapping) or not sources:
            raise TypeError(
                "evenly.Mix needs a non-empty mapping of name -> source, e.g. "
                f"evenly.Mix({{'web': web, 'code': code}}); got {type(sources).__name__}"
            )
        self.names: tuple[str, ...] = tuple(str(name) for name in sources)
        for name, source in sources.items():
            if not (hasattr(source, "__len__") and hasattr(source, "__getitem__")):
                raise TypeError(
                    f"evenly.Mix: source {name!r} ({type(source).__name__}) has no __len__ "
                    "and __getitem__: pass a list, an array, a map-style Dataset or an "
                    "evenly file source"
                )
        self._sources = [sources[name] for name in sources]
        self.lengths: tuple[int, ...] = tuple(len(s) for s in self._sources)
        self.weights = None if weights is None else self._check_weights(weights)
        if samples_per_epoch is not None:
            samples_per_epoch = check_int("samples_per_epoch", samples_per_epoch, minimum=1)
        self.samples_per_epoch = samples_per_epoch
        self.min_step = None if min_step is None else check_int("min_step", min_step, minimum=1)
        self._counts = mix_counts(
            self.lengths,
            None if self.weights is None else [self.weights[n] for n in self.names],
            samples_per_epoch,
            names=self.names,
        )
        ends = np.cumsum(np.array(self.lengths, dtype=np.int64))
        self._ends = ends
        self._base = ends - np.array(self.lengths, dtype=np.int64)
        #: (stream offsets at the start of epoch, that epoch), once a state fixed them
        self._fixed: tuple[tuple[int, ...], int] | None = None
        #: (epoch, position, segments before it, hold) of a loaded mid-epoch state
        self._resume: tuple[int, int, tuple[tuple[int, int], ...], int] | None = None
        #: epoch -> the (segments, hold) of the orders planned in this process
        self._planned: dict[int, list[tuple[tuple[tuple[int, int], ...], int]]] = {}

    def _check_weights(self, weights: Mapping[str, float]) -> dict[str, float]:
        if not isinstance(weights, Mapping):
            raise TypeError(
                f"evenly.Mix: weights must map source names to numbers, e.g. "
                f"{{{self.names[0]!r}: 0.7, ...}}; got {type(weights).__name__}"
            )
        unknown = [str(k) for k in weights if str(k) not in self.names]
        missing = [n for n in self.names if n not in weights]
        if unknown or missing:
            raise ValueError(
                f"evenly.Mix: weights must name exactly the sources {list(self.names)}; "
                + (f"unknown: {unknown} " if unknown else "")
                + (f"missing: {missing} (give weight 0 to leave one out)" if missing else "")
            )
        out = {}
        for name in self.names:
            w = weights[name]
            if isinstance(w, bool) or not isinstance(w, int | float | np.integer | np.floating):
                raise TypeError(
                    f"evenly.Mix: weight of source {name!r} must be a number, got {w!r}"
                )
            if not np.isfinite(w) or w < 0:
                raise ValueError(f"evenly.Mix: weight of source {name!r} must be >= 0, got {w}")
            out[name] = float(w)
        return out

    # ---- the Source protocol -----------------------------------------------------
    def __len__(self) -> int:
        """Samples per epoch."""
        return sum(self._counts)

    @property
    def counts(self) -> dict[str, int]:
        """Samples each source contributes per epoch."""
        return dict(zip(self.names, self._counts, strict=True))

    @property
    def preferred_shuffle(self) -> str:
        """``shuffle=True`` shuffles each source's passes (the mixture order is the Mix's)."""
        return "global"

    @property
    def fingerprint(self) -> str:
        """Identity for checkpoints: the source names and lengths (and each source's own
        fingerprint where it has one), not the weights: a state may change those."""
        parts = []
        for name, n, source in zip(self.names, self.lengths, self._sources, strict=True):
            own = getattr(source, "fingerprint", None)
            parts.append(f"{name}: {n}" + (f" [{own}]" if isinstance(own, str) else ""))
        return "evenly.Mix(" + ", ".join(parts) + ")"

    def source_of(self, indices: npt.ArrayLike) -> I64:
        """The source number (into ``names``) of each index, e.g. for per-source counts."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        total = int(self._ends[-1])
        if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= total):
            bad = int(idx[(idx < 0) | (idx >= total)][0])
            raise IndexError(
                f"evenly.Mix: index {bad} is out of range [0, {total}) (the concatenated "
                f"sources {dict(zip(self.names, self.lengths, strict=True))})"
            )
        return np.searchsorted(self._ends, idx, side="right").astype(np.int64)

    def __getitem__(self, index: int) -> Any:
        (d,) = self.source_of([index]).tolist()
        return self._sources[d][int(index) - int(self._base[d])]

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """Read a batch: each source once (its own ``__getitems__`` when it has one)."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        src = self.source_of(idx)
        out: list[Any] = [None] * idx.size
        for d in np.unique(src).tolist():
            where = np.flatnonzero(src == d)
            local = (idx[where] - self._base[d]).tolist()
            getitems = getattr(self._sources[d], "__getitems__", None)
            if getitems is not None:
                samples = list(getitems(local))
            else:
                samples = [self._sources[d][i] for i in local]
            for pos, sample in zip(where.tolist(), samples, strict=True):
                out[pos] = sample
        return out

    def prefetch(self, indices: Sequence[int]) -> None:
        """Pass a prefetch hint on to the sources that take one."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        src = self.source_of(idx)
        for d in dict.fromkeys(src.tolist()):
            prefetch = getattr(self._sources[d], "prefetch", None)
            if prefetch is not None:
                prefetch((idx[src == d] - self._base[d]).tolist())

    def locate(self, index: int) -> str:
        """Where sample ``index`` lives: the source's name and index (and its own locate)."""
        (d,) = self.source_of([index]).tolist()
        local = int(index) - int(self._base[d])
        where = f"source {self.names[d]!r} sample {local}"
        inner = getattr(self._sources[d], "locate", None)
        return where + (f" ({inner(local)})" if inner is not None else "")

    # ---- planning ----------------------------------------------------------------
    def stream_offsets(self, epoch: int) -> dict[str, int]:
        """Each stream's offset at the start of ``epoch`` (items read before it)."""
        return dict(zip(self.names, self._epoch_start(epoch), strict=True))

    def _epoch_start(self, epoch: int) -> tuple[int, ...]:
        if self._fixed is None:
            return epoch_offsets(self._counts, epoch)
        fixed, fixed_epoch = self._fixed
        return epoch_offsets(self._counts, epoch, fixed=fixed, fixed_epoch=fixed_epoch)

    def _order(
        self, seed: int, epoch: int, shuffle: bool, segments: Sequence[tuple[int, int]], hold: int
    ) -> MixOrder:
        *history, (start, step) = segments
        return MixOrder(
            self.lengths,
            self._counts,
            self._epoch_start(epoch),
            names=self.names,
            seed=seed,
            epoch=epoch,
            shuffle=shuffle,
            step=step,
            start=start,
            history=history,
            hold=hold,
        )

    def epoch_order(
        self, seed: int, epoch: int, *, shuffle: bool, step: int, start: int = 0
    ) -> MixOrder | _TooSmallStep:
        """Epoch ``epoch``'s order (position -> index) dealt in global steps of ``step``
        from position ``start`` (a resume: only after loading a state of that position).
        O(number of sources): ``evenly.Dataset`` calls it once per pass and worker.

        >>> mix = Mix({"a": [0, 1, 2], "b": [10, 11]}, weights={"a": 1, "b": 1},
        ...           samples_per_epoch=4)
        >>> order = mix.epoch_order(0, 0, shuffle=False, step=2)
        >>> sorted(mix.__getitems__(order(range(4)).tolist()))
        [0, 1, 10, 11]
        """
        step = check_int("step", step, minimum=1)
        start = check_int("start", start, minimum=0)
        hold = step if self.min_step is None else self.min_step
        history: tuple[tuple[int, int], ...] = ()
        if start:
            resume = self._resume
            if resume is None or resume[:2] != (epoch, start):
                raise ValueError(
                    f"evenly.Mix: a pass of epoch {epoch} cannot start at position {start} "
                    "without a loaded state of that position (load_state_dict)"
                )
            history, hold = resume[2], resume[3]
        if step < hold:  # refused when read, so that len(dataset) still works
            return _TooSmallStep(
                f"evenly.Mix: the global step (world_size x batch_size) is {step} but epoch "
                f"{epoch} was {'started' if start else 'set up'} with steps of at least {hold}"
                ": a mixture stays exact only if no step is smaller.  Resume at an epoch "
                f"boundary, keep world_size x batch_size >= {hold}, or build the Mix with "
                "min_step=<the smallest step> from the start (under a loader other than "
                "evenly.DataLoader the step is world_size)"
            )
        segments = (*history, (start, step))
        try:
            order = self._order(seed, epoch, shuffle, segments, hold)
        except ValueError as exc:
            raise ValueError(f"evenly.Mix, epoch {epoch}: {exc}") from exc
        planned = self._planned.setdefault(epoch, [])
        if (segments, hold) not in planned:
            planned.append((segments, hold))
            del planned[:-_REMEMBERED]
        for old in [e for e in self._planned if e < epoch - 1]:
            del self._planned[old]
        return order

    def bounds(self, step: int) -> dict[str, float]:
        """Per source: ``|count among the first P positions - P * c_d / len| <= bound``
        at every step boundary ``P`` of an epoch dealt in steps of ``step``."""
        order = self._order(
            0, 0, False, [(0, step)], step if self.min_step is None else self.min_step
        )
        return dict(zip(self.names, order.bounds, strict=True))

    # ---- checkpoints ---------------------------------------------------------------
    def source_state(self, epoch: int, position: int) -> dict[str, Any]:
        """The mixture's part of a checkpoint at ``position`` of ``epoch`` (a global step
        boundary): each stream's offset at the epoch start and at ``position``, the
        counts, and the steps the epoch was dealt in (JSON-serialisable)."""
        start = self._epoch_start(epoch)
        segments: list[list[int]] = []
        hold: int | None = None
        now = start
        if position:
            segments, hold, now = self._dealt(epoch, position)
        return {
            "names": list(self.names),
            "lengths": list(self.lengths),
            "counts": list(self._counts),
            "epoch": epoch,
            "position": position,
            "epoch_offsets": list(start),
            "offsets": list(now),
            "segments": segments,
            "hold": hold,
        }

    def _dealt(self, epoch: int, position: int) -> tuple[list[list[int]], int, tuple[int, ...]]:
        """The segments and hold of this process's pass of ``epoch`` that reached
        ``position``: of several planned (say a loader's and ``len(dataset)``'s), the one
        with the largest step at ``position``."""
        resume = self._resume
        if resume is not None and resume[:2] == (epoch, position):  # loaded, not yet read
            history, hold = resume[2], resume[3]
            order = self._order(0, epoch, False, (*history, (position, hold)), hold)
            return [[s, g] for s, g in history], hold, order.offsets_at(position)
        candidates = self._planned.get(epoch, [])
        best: tuple[int, list[list[int]], int, tuple[int, ...]] | None = None
        for segments, hold in candidates:
            try:
                order = self._order(0, epoch, False, segments, hold)
                offsets = order.offsets_at(position)
            except ValueError:
                continue
            before = [[s, g] for s, g in segments if s < position]
            if best is None or before[-1][1] >= best[0]:
                best = (before[-1][1], before, hold, offsets)
        if best is None:
            raise ValueError(
                f"evenly.Mix: position {position} of epoch {epoch} is not a global step "
                "boundary of a pass planned in this process: a mixture is checkpointed "
                "exactly only after whole global steps (take the state from "
                "loader.state_dict() in the process that iterates)"
            )
        return best[1], best[2], best[3]

    def load_source_state(self, state: Any, epoch: int, position: int) -> None:
        """Check the mixture's part of a checkpoint and continue every stream from it.

        Other source names or lengths raise ``evenly.StateError`` naming the source; at
        an epoch boundary (``position == 0``) other weights or ``samples_per_epoch`` are
        fine (each stream continues where it stopped); mid-epoch they raise.
        """
        if not isinstance(state, dict) or "epoch_offsets" not in state:
            raise StateError(
                "evenly.Mix: the state has no mixture part ('source_state'): it was not "
                "saved by a dataset over an evenly.Mix"
            )
        names, lengths = list(state.get("names", [])), list(state.get("lengths", []))
        for d, name in enumerate(self.names):
            if name not in names:
                raise StateError(
                    f"evenly.Mix: source {name!r} is not in the saved mixture {names}: "
                    "resume with the same sources (names and lengths)"
                )
            saved = lengths[names.index(name)]
            if saved != self.lengths[d]:
                raise StateError(
                    f"evenly.Mix: source {name!r} has {self.lengths[d]} samples but had "
                    f"{saved} when the state was saved: its streams cannot continue"
                )
        if names != list(self.names):
            raise StateError(
                f"evenly.Mix: the saved mixture has sources {names}, this one "
                f"{list(self.names)}: resume with the same sources in the same order"
            )
        if (state.get("epoch"), state.get("position")) != (epoch, position):
            raise StateError(
                f"evenly.Mix: the mixture part is for epoch {state.get('epoch')} position "
                f"{state.get('position')}, the state for epoch {epoch} position {position}"
            )
        offsets = tuple(check_int("stream offset", o, minimum=0) for o in state["epoch_offsets"])
        if len(offsets) != len(self.names):
            raise StateError(
                f"evenly.Mix: {len(offsets)} stream offsets for {len(self.names)} sources"
            )
        resume = None
        if position:
            if list(state.get("counts", [])) != list(self._counts):
                saved_counts = dict(zip(names, state.get("counts", []), strict=False))
                raise StateError(
                    f"evenly.Mix: the state is mid-epoch (epoch {epoch}, position {position}) "
                    f"and was saved with per-epoch counts {saved_counts}, this Mix has "
                    f"{self.counts}: other weights or samples_per_epoch work "
                    "only at an epoch boundary; finish the epoch with the old Mix, or load a "
                    "state saved at the end of an epoch"
                )
            segments = tuple((int(s), int(g)) for s, g in state.get("segments", []))
            hold = check_int("state hold", state.get("hold"), minimum=1)
            try:  # the saved steps must reach ``position`` exactly
                MixOrder(
                    self.lengths, self._counts, offsets, names=self.names, seed=0,
                    epoch=epoch, shuffle=False, step=hold, start=position,
                    history=segments, hold=hold,
                )  # fmt: skip
            except ValueError as exc:
                raise StateError(f"evenly.Mix: the saved step history is invalid: {exc}") from exc
            resume = (epoch, position, segments, hold)
        self._fixed = (offsets, epoch)
        self._resume = resume
        self._planned = {}

    def __repr__(self) -> str:
        return f"evenly.Mix({self.counts}, samples_per_epoch={len(self)})"
