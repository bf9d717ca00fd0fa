"""``evenly.Mix``: weighted sources with exact proportions, each source an endless stream of
its own passes (every sample once before any twice), exact elastic resume, and weight
changes (``set_weights``, or at an epoch boundary) that continue every stream.

The source ``evenly.Dataset`` reads; the planning math is in :mod:`evenly.core.mix`, and what
a pass carries (stream offsets, steps, weight changes) is in the owner's pass state
(:mod:`evenly.core.mix.checkpoint`), never on the Mix.  No torch, no I/O of its own.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from evenly.core.mix.apportion import check_weights, mix_counts
from evenly.core.mix.checkpoint import (
    EpochSetup,
    MixPart,
    Weights,
    check_saved_part,
    epoch_setup,
    saved_weights,
    with_weights,
)
from evenly.core.mix.order import MixOrder, TooSmallStep
from evenly.core.mix.sources import Sources
from evenly.core.mix.tokens import check_token_state, check_unit, token_shares
from evenly.errors import StateError, check_int
from evenly.options import Unit

__all__ = ["Mix"]

I64 = npt.NDArray[np.int64]


class Mix(Sources):
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
        weights: name -> weight >= 0 (default: proportional to the lengths, or under
            ``unit="tokens"`` to each source's tokens).
        samples_per_epoch: the epoch length (default: the sum of the lengths).
        unit: ``"samples"`` (the default) or ``"tokens"``: for packing
            (``evenly.Dataset(mix, pack=evenly.Packing(...))``), the weights are shares of
            **tokens**, each source's documents cut into ``seq_len`` pieces and merged so
            that every prefix of the epoch holds each source's share within a bound
            (``docs/packing.md``; half a row for two sources, under one row for three).
        tokens_per_epoch: ``unit="tokens"``: the epoch's tokens (default: every source's
            tokens once); each source is an endless stream of its passes.
        min_step: the smallest global step (``world_size * batch_size``) this run will
            ever use, resumes included (default: each epoch's first step, the tightest
            bound; a resume onto a smaller step raises).  ``min_step=batch_size`` allows
            any world size, with a weaker bound for sources under one slot per step.

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
        unit: Unit = "samples",
        tokens_per_epoch: int | None = None,
    ) -> None:
        if not isinstance(sources, Mapping) or not sources:
            raise TypeError(
                "evenly.Mix needs a non-empty mapping of name -> source, e.g. "
                f"evenly.Mix({{'web': web, 'code': code}}); got {type(sources).__name__}"
            )
        for name, source in sources.items():
            if not (hasattr(source, "__len__") and hasattr(source, "__getitem__")):
                raise TypeError(
                    f"evenly.Mix: source {name!r} ({type(source).__name__}) has no __len__ "
                    "and __getitem__: pass a list, an array, a map-style Dataset or an "
                    "evenly file source"
                )
        nested = [n for n, s in sources.items() if isinstance(s, Mix)]
        if nested:
            raise TypeError(
                f"evenly.Mix: source {nested[0]!r} is itself an evenly.Mix; a Mix inside a Mix "
                "is not supported (its epochs are planned by weight, not indexed): give all "
                "the sources to one Mix, with weights multiplied out"
            )
        super().__init__(sources)
        self.weights = None if weights is None else check_weights(self.names, weights)
        if samples_per_epoch is not None:
            samples_per_epoch = check_int("samples_per_epoch", samples_per_epoch, minimum=1)
        self.samples_per_epoch = samples_per_epoch
        self.min_step = None if min_step is None else check_int("min_step", min_step, minimum=1)
        w = None if self.weights is None else [self.weights[n] for n in self.names]
        self.unit = check_unit(unit, samples_per_epoch, min_step, tokens_per_epoch)
        self.tokens_per_epoch = tokens_per_epoch
        if unit == "tokens":  # the epoch's documents are found once their tokens are known
            self._counts = self.lengths
            return
        self._counts = mix_counts(self.lengths, w, samples_per_epoch, names=self.names)

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
        views = zip(self.names, self.lengths, self._views, strict=True)
        parts = [
            f"{name}: {n}" + ("" if v.fingerprint is None else f" [{v.fingerprint}]")
            for name, n, v in views
        ]
        return "evenly.Mix(" + ", ".join(parts) + ")"

    def __getitem__(self, index: int) -> Any:
        """A Mix is not a sequence: ``len(mix)`` is the samples per epoch, while its
        indices span the concatenated sources, so code that indexes ``range(len(mix))``
        (``torch.utils.data.Subset``, ``evenly.write``, a Mix inside a Mix) would read a
        prefix only.  Read it through ``evenly.Dataset(mix)``."""
        raise TypeError(
            "evenly.Mix is not a sequence: len(mix) is the samples per epoch, but its "
            "indices span the concatenated sources, so indexing it would read only a "
            "prefix; wrap it: evenly.Dataset(mix) (read_one/read_many take global indices)"
        )

    # ---- planning ----------------------------------------------------------------
    def stream_offsets(self, epoch: int, part: Any = None) -> dict[str, int]:
        """Each stream's offset at the start of ``epoch`` (items read before it), from
        epoch 0 or from the anchor of a loaded state (``part``)."""
        offsets = self._setup(epoch, MixPart.from_json(part)).offsets
        return dict(zip(self.names, offsets, strict=True))

    def _counts_of(self, weights: Weights | None, positions: int) -> tuple[int, ...]:
        if weights is None and positions == len(self):
            return self._counts
        if weights is None:
            own = self.weights
            weights = tuple(float(n) for n in self.lengths) if own is None else tuple(own.values())
        return mix_counts(self.lengths, weights, positions, names=self.names)

    def _setup(self, epoch: int, part: MixPart | None) -> EpochSetup:
        return epoch_setup(part, epoch, len(self), self._counts_of)

    def _order(
        self,
        seed: int,
        epoch: int,
        shuffle: bool,
        segments: Sequence[tuple[int, int]],
        hold: int,
        part: MixPart | None,
    ) -> MixOrder:
        *history, (start, step) = segments
        setup = self._setup(epoch, part)
        return MixOrder(
            self.lengths,
            setup.counts,
            setup.offsets,
            names=self.names,
            seed=seed,
            epoch=epoch,
            shuffle=shuffle,
            step=step,
            start=start,
            history=history,
            hold=hold,
            changes=setup.changes,
        )

    def epoch_order(
        self,
        seed: int,
        epoch: int,
        *,
        shuffle: bool,
        step: int,
        start: int = 0,
        part: Any = None,
    ) -> MixOrder | TooSmallStep:
        """Epoch ``epoch``'s order (position -> index) dealt in global steps of ``step``
        from position ``start`` (a resume: only with the ``part`` of a loaded state of that
        position, as the pass state carries it).  O(number of sources):
        ``evenly.Dataset`` calls it once per pass and worker.

        >>> mix = Mix({"a": [0, 1, 2], "b": [10, 11]}, weights={"a": 1, "b": 1},
        ...           samples_per_epoch=4)
        >>> order = mix.epoch_order(0, 0, shuffle=False, step=2)
        >>> sorted(mix.read_many(order(range(4)).tolist()))
        [0, 1, 10, 11]
        """
        if self.unit == "tokens":
            raise ValueError(
                "an evenly.Mix(unit='tokens') is planned by its packing: read it as "
                "evenly.Dataset(mix, pack=evenly.Packing(seq_len, ...))"
            )
        step = check_int("step", step, minimum=1)
        start = check_int("start", start, minimum=0)
        loaded = MixPart.from_json(part)
        hold = step if self.min_step is None else self.min_step
        history: tuple[tuple[int, int], ...] = ()
        if start:
            if loaded is None or loaded.resume is None or loaded.hold is None:
                raise ValueError(
                    f"evenly.Mix: a pass of epoch {epoch} cannot start at position {start} "
                    "without a loaded state of that position (load_state_dict)"
                )
            history, hold = loaded.resume, loaded.hold
        if step < hold:  # refused when read, so that len(dataset) still works
            return TooSmallStep.of(step, epoch, hold, started=bool(start))
        try:
            return self._order(seed, epoch, shuffle, (*history, (start, step)), hold, loaded)
        except ValueError as exc:
            raise ValueError(f"evenly.Mix, epoch {epoch}: {exc}") from exc

    def bounds(self, step: int) -> dict[str, float]:
        """Per source: ``|count among the first P positions - P * c_d / len| <= bound``
        at every step boundary ``P`` of an epoch dealt in steps of ``step``."""
        hold = step if self.min_step is None else self.min_step
        order = self._order(0, 0, False, [(0, step)], hold, None)
        return dict(zip(self.names, order.bounds, strict=True))

    # ---- checkpoints ---------------------------------------------------------------
    def source_state(
        self, epoch: int, position: int, part: Any = None, order: Any = None
    ) -> dict[str, Any]:
        """The mixture's part of a checkpoint at ``position`` of ``epoch`` (a global step
        boundary of the pass's ``order``): each stream's offset at the epoch start and at
        ``position``, the counts, and the steps the epoch was dealt in
        (JSON-serialisable).  ``part`` is what the pass state carries (a loaded state's
        anchor and resume)."""
        if self.unit == "tokens":  # the streams' anchor and weight changes, if any
            return {**self._token_state(), "part": part or None}
        loaded = MixPart.from_json(part)
        setup = self._setup(epoch, loaded)
        segments: list[list[int]] = []
        hold = 0  # none yet: the epoch's steps are known once a pass is dealt
        now = setup.offsets
        if position:
            segments, hold, now = self._dealt(epoch, position, loaded, order)
        return {
            "names": list(self.names),
            "lengths": list(self.lengths),
            "counts": list(setup.counts),
            "epoch": epoch,
            "position": position,
            "epoch_offsets": list(setup.offsets),
            "offsets": list(now),
            "segments": segments,
            "hold": hold or (loaded.hold if loaded and loaded.hold else 0),
            "weights": None if setup.weights is None else list(setup.weights),
            "changes": [[p, list(w)] for p, w in setup.weight_changes],
        }

    def _dealt(
        self, epoch: int, position: int, part: MixPart | None, order: Any
    ) -> tuple[list[list[int]], int, tuple[int, ...]]:
        """The segments, hold and stream offsets of the pass that reached ``position``
        (from its ``order``, or the loaded ``part`` when that pass starts there)."""
        if not (isinstance(order, MixOrder) and order.epoch == epoch):
            if part is None or part.resume is None or part.hold is None:
                order = None
            else:  # a loaded state not read yet: its own resume point
                order = self._order(
                    0, epoch, False, (*part.resume, (position, part.hold)), part.hold, part
                )
        try:
            if order is None:
                raise ValueError("no pass")
            offsets = order.offsets_at(position)
        except ValueError:
            raise ValueError(
                f"evenly.Mix: position {position} of epoch {epoch} is not a global step "
                "boundary of the pass in progress: a mixture is checkpointed "
                "exactly only after whole global steps (take the state from "
                "loader.state_dict() in the process that iterates)"
            ) from None
        before = [[s, g] for s, g in order.segments if s < position]
        return before, order.hold, offsets

    def carried_part(self, part: Any) -> Any:
        """What of a pass state's ``part`` holds for the owner's later passes (the
        anchor: streams continue from the loaded offsets)."""
        if self.unit == "tokens":  # its anchor and changes hold for the later epochs
            return part or None
        loaded = MixPart.from_json(part)
        return None if loaded is None else loaded.carried().to_json()

    def load_source_state(self, state: Any, epoch: int, position: int) -> dict[str, Any]:
        """Check the mixture's part of a checkpoint; return what the pass state carries
        from it (every stream continues from the saved offsets; mid-epoch, the steps).

        Other source names or lengths raise ``evenly.StateError`` naming the source; at
        an epoch boundary (``position == 0``) other weights or ``samples_per_epoch`` are
        fine (each stream continues where it stopped); mid-epoch they raise.
        """
        if self.unit == "tokens" or (isinstance(state, dict) and "unit" in state):
            return check_token_state(state, self._token_state(), self.names)
        saved, changes = saved_weights(state, len(self.names))
        offsets, segments, hold = check_saved_part(
            state, self.names, self.lengths, self._counts_of(saved, len(self)), epoch, position
        )
        if changes and not position:
            raise StateError("evenly.Mix: a state at an epoch start lists weight changes")
        if changes:
            hold = hold or check_int("state hold", state.get("hold"), minimum=1)
        part = MixPart(epoch, offsets, None, hold if changes else None, saved, changes)
        if position:
            assert hold is not None
            part = MixPart(epoch, offsets, segments, hold, saved, changes)
            try:  # the saved steps and weight changes must reach ``position`` exactly
                self._order(0, epoch, False, (*segments, (position, hold)), hold, part)
            except ValueError as exc:
                raise StateError(f"evenly.Mix: the saved step history is invalid: {exc}") from exc
        return part.to_json()

    def reweighted(self, state: Any, weights: Mapping[str, float]) -> dict[str, Any]:
        """The mixture part of a checkpoint (:meth:`source_state`) with ``weights`` from
        its position on (``set_weights``): mid-epoch, a weight change there; at an epoch
        start, the epoch's weights.  Later epochs keep them until changed."""
        if self.unit == "tokens":
            raise TypeError("a token mixture is reweighted by its packing (evenly.Dataset)")
        checked = check_weights(self.names, weights)
        vector = [checked[n] for n in self.names]
        counts = self._counts_of(tuple(vector), len(self) - state["position"])  # checks them
        return with_weights(state, vector, list(counts))

    # ---- unit="tokens" -------------------------------------------------------------
    def token_shares(self, totals: Sequence[int]) -> tuple[int, ...]:
        """``unit="tokens"``: each source's tokens per epoch, given each source's tokens
        (``totals``, one pass): ``w_d / sum(w) * tokens_per_epoch`` by largest remainder."""
        w = None if self.weights is None else [self.weights[n] for n in self.names]
        return token_shares(totals, w, self.tokens_per_epoch, names=self.names)

    def _token_state(self) -> dict[str, Any]:
        """A token mixture's part of a checkpoint: what its epochs depend on (each
        stream's offset at epoch ``e`` is ``e`` times its share)."""
        return {
            "unit": "tokens",
            "names": list(self.names),
            "lengths": list(self.lengths),
            "weights": None if self.weights is None else list(self.weights.values()),
            "tokens_per_epoch": self.tokens_per_epoch,
            "merge": 2,  # midpoint, or deadline where a source dominates (since 0.2)
        }

    def __repr__(self) -> str:
        if self.unit == "tokens":
            return f"evenly.Mix({self.weights}, unit='tokens', tokens={self.tokens_per_epoch})"
        return f"evenly.Mix({self.counts}, samples_per_epoch={len(self)})"
