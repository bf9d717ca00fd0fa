"""A mixture's part of a pass state, and of a checkpoint.

A pass over an ``evenly.Mix`` needs two things a plain source does not: the stream
offsets a loaded state fixed (its *anchor*: every later epoch of the same owner continues
the streams from it), and, for a pass that starts inside an epoch, the steps the epoch
was dealt in before (its *resume*).  Both travel with the pass state of the owner that
loaded them (a loader, a sampler, the dataset's own passes), never on the Mix, so two
owners of one Mix never see each other's.  As JSON-serialisable dicts they also travel in
the pass spec to the workers.

Pure Python: no torch, no I/O.

>>> part = MixPart(anchor_epoch=3, anchor_offsets=(10, 4), resume=((0, 8),), hold=8)
>>> MixPart.from_json(part.to_json()) == part
True
>>> part.carried()
MixPart(anchor_epoch=3, anchor_offsets=(10, 4), resume=None, hold=None, weights=None, changes=())
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from evenly.core.mix.apportion import Segmented, epoch_offsets
from evenly.errors import StateError, check_int

__all__ = [
    "EpochSetup",
    "MixPart",
    "check_saved_part",
    "epoch_setup",
    "saved_weights",
    "with_weights",
]


Weights = tuple[float, ...]


@dataclass(frozen=True)
class MixPart:
    """The anchor (``anchor_offsets`` at the start of ``anchor_epoch``) and, for a pass
    starting inside an epoch, the ``(start, step)`` segments dealt before it (``resume``)
    and the epoch's ``hold``.  After ``set_weights``: the weights in force from the
    anchor epoch's start (``weights``; ``None``: the Mix's own) and the anchor epoch's
    weight changes as ``(position, weights)`` (``changes``)."""

    anchor_epoch: int
    anchor_offsets: tuple[int, ...]
    resume: tuple[tuple[int, int], ...] | None = None
    hold: int | None = None
    weights: Weights | None = None
    changes: tuple[tuple[int, Weights], ...] = ()

    def carried(self) -> MixPart:
        """What holds for the owner's later passes: the anchor, its weights and the
        anchor epoch's weight changes (with the hold they were apportioned with)."""
        hold = self.hold if self.changes else None
        return MixPart(
            self.anchor_epoch, self.anchor_offsets, None, hold, self.weights, self.changes
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "anchor_epoch": self.anchor_epoch,
            "anchor_offsets": list(self.anchor_offsets),
            "resume": None if self.resume is None else [list(s) for s in self.resume],
            "hold": self.hold,
            "weights": None if self.weights is None else list(self.weights),
            "changes": [[p, list(w)] for p, w in self.changes],
        }

    @classmethod
    def from_json(cls, value: Any) -> MixPart | None:
        """The part a pass state carries (``None``: no state was loaded)."""
        if value is None:
            return None
        if isinstance(value, MixPart):
            return value
        resume, weights = value.get("resume"), value.get("weights")
        return cls(
            int(value["anchor_epoch"]),
            tuple(int(o) for o in value["anchor_offsets"]),
            None if resume is None else tuple((int(s), int(g)) for s, g in resume),
            None if value.get("hold") is None else int(value["hold"]),
            None if weights is None else tuple(float(w) for w in weights),
            tuple((int(p), tuple(float(x) for x in w)) for p, w in value.get("changes", ())),
        )


def check_saved_part(
    state: Any,
    names: tuple[str, ...],
    lengths: tuple[int, ...],
    counts: tuple[int, ...],
    epoch: int,
    position: int,
) -> tuple[tuple[int, ...], tuple[tuple[int, int], ...], int | None]:
    """Check a checkpoint's mixture part (``source_state``) against this mixture's
    sources; return (stream offsets at the epoch start, the segments dealt before
    ``position``, the epoch's hold).

    Other source names or lengths raise ``evenly.StateError`` naming the source; at an
    epoch boundary (``position == 0``) other weights or ``samples_per_epoch`` are fine
    (each stream continues where it stopped); mid-epoch they raise.
    """
    if not isinstance(state, dict) or "epoch_offsets" not in state:
        raise StateError(
            "evenly.Mix: the state has no mixture part ('source_state'): it was not "
            "saved by a dataset over an evenly.Mix"
        )
    saved_names, saved_lengths = list(state.get("names", [])), list(state.get("lengths", []))
    for d, name in enumerate(names):
        if name not in saved_names:
            raise StateError(
                f"evenly.Mix: source {name!r} is not in the saved mixture {saved_names}: "
                "resume with the same sources (names and lengths)"
            )
        saved = saved_lengths[saved_names.index(name)]
        if saved != lengths[d]:
            raise StateError(
                f"evenly.Mix: source {name!r} has {lengths[d]} samples but had "
                f"{saved} when the state was saved: its streams cannot continue"
            )
    if saved_names != list(names):
        raise StateError(
            f"evenly.Mix: the saved mixture has sources {saved_names}, this one "
            f"{list(names)}: resume with the same sources in the same order"
        )
    if (state.get("epoch"), state.get("position")) != (epoch, position):
        raise StateError(
            f"evenly.Mix: the mixture part is for epoch {state.get('epoch')} position "
            f"{state.get('position')}, the state for epoch {epoch} position {position}"
        )
    offsets = tuple(check_int("stream offset", o, minimum=0) for o in state["epoch_offsets"])
    if len(offsets) != len(names):
        raise StateError(f"evenly.Mix: {len(offsets)} stream offsets for {len(names)} sources")
    if not position:
        return offsets, (), None
    if list(state.get("counts", [])) != list(counts):
        saved_counts = dict(zip(saved_names, state.get("counts", []), strict=False))
        raise StateError(
            f"evenly.Mix: the state is mid-epoch (epoch {epoch}, position {position}) "
            f"and was saved with per-epoch counts {saved_counts}, this Mix has "
            f"{dict(zip(names, counts, strict=True))}: other weights or samples_per_epoch "
            "work only at an epoch boundary; finish the epoch with the old Mix, or load a "
            "state saved at the end of an epoch"
        )
    segments = tuple((int(s), int(g)) for s, g in state.get("segments", []))
    hold = check_int("state hold", state.get("hold"), minimum=1)
    return offsets, segments, hold


#: counts per epoch of the given weights over the given positions (None: the Mix's own)
CountsOf = Callable[[Weights | None, int], tuple[int, ...]]


@dataclass(frozen=True)
class EpochSetup:
    """What an epoch's order needs from a pass state's part: the counts at the epoch
    start, each stream's offset there, and the epoch's weight changes as ``(position,
    counts of the rest of the epoch)``."""

    weights: Weights | None
    counts: tuple[int, ...]
    offsets: tuple[int, ...]
    changes: tuple[tuple[int, tuple[int, ...]], ...]
    #: the epoch's weight changes as given, ``(position, weights)``
    weight_changes: tuple[tuple[int, Weights], ...]


def epoch_setup(part: MixPart | None, epoch: int, total: int, counts_of: CountsOf) -> EpochSetup:
    """Epoch ``epoch`` under ``part``: from epoch 0 with the Mix's weights (``None``), or
    from the anchor; an anchor epoch with weight changes ends where its apportionment
    takes each stream, and the last weights hold for the epochs after it.

    >>> counts_of = lambda w, n: (n // 2, n - n // 2) if w is None else (n, 0)
    >>> epoch_setup(None, 2, 10, counts_of).offsets
    (10, 10)
    >>> part = MixPart(1, (5, 5), hold=2, changes=((4, (1.0, 0.0)),))
    >>> setup = epoch_setup(part, 1, 10, counts_of)
    >>> setup.counts, setup.changes
    ((5, 5), ((4, (6, 0)),))
    >>> epoch_setup(part, 3, 10, counts_of).offsets  # epoch 1 took (8, 2), then (10, 0)s
    (23, 7)
    """
    if part is None:
        counts = counts_of(None, total)
        return EpochSetup(None, counts, epoch_offsets(counts, epoch), (), ())
    while part.changes and epoch > part.anchor_epoch:
        counts = counts_of(part.weights, total)
        rest = [(p, counts_of(w, total - p)) for p, w in part.changes]
        if part.hold is None:
            raise ValueError("a Mix part with weight changes must record its hold")
        ends = Segmented([(0, counts), *rest], part.hold).totals
        offsets = tuple(o + t for o, t in zip(part.anchor_offsets, ends, strict=True))
        part = MixPart(part.anchor_epoch + 1, offsets, weights=part.changes[-1][1])
    counts = counts_of(part.weights, total)
    offsets = epoch_offsets(counts, epoch, fixed=part.anchor_offsets, fixed_epoch=part.anchor_epoch)
    changes = part.changes if epoch == part.anchor_epoch else ()
    tail = tuple((p, counts_of(w, total - p)) for p, w in changes)
    return EpochSetup(part.weights, counts, offsets, tail, changes)


def saved_weights(
    state: Any, num_sources: int
) -> tuple[Weights | None, tuple[tuple[int, Weights], ...]]:
    """A checkpoint's mixture weights at its epoch start (``None``: the Mix's own) and
    its epoch's weight changes, checked for shape."""
    weights = state.get("weights") if isinstance(state, dict) else None
    saved = None if weights is None else tuple(float(w) for w in weights)
    changes = tuple(
        (check_int("weight change position", p, minimum=1), tuple(float(x) for x in w))
        for p, w in (state.get("changes", ()) if isinstance(state, dict) else ())
    )
    for w in ([saved] if saved is not None else []) + [w for _, w in changes]:
        if len(w) != num_sources:
            raise StateError(f"evenly.Mix: {len(w)} saved weights for {num_sources} sources")
    return saved, changes


def with_weights(state: dict[str, Any], vector: list[float], counts: list[int]) -> dict[str, Any]:
    """A checkpoint's mixture part with ``vector`` from its position on: a weight change
    there (replacing one at the same position), or, at an epoch start, the epoch's
    weights and ``counts``."""
    position = state["position"]
    if position:
        kept = [c for c in state.get("changes", []) if c[0] < position]
        return {**state, "changes": [*kept, [position, vector]]}
    return {**state, "weights": vector, "counts": counts, "changes": []}
