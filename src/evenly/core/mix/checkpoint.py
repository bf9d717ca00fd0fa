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
MixPart(anchor_epoch=3, anchor_offsets=(10, 4), resume=None, hold=None)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from evenly.errors import StateError, check_int

__all__ = ["MixPart", "check_saved_part"]


@dataclass(frozen=True)
class MixPart:
    """The anchor (``anchor_offsets`` at the start of ``anchor_epoch``) and, for a pass
    starting inside an epoch, the ``(start, step)`` segments dealt before it (``resume``)
    and the epoch's ``hold``."""

    anchor_epoch: int
    anchor_offsets: tuple[int, ...]
    resume: tuple[tuple[int, int], ...] | None = None
    hold: int | None = None

    def carried(self) -> MixPart:
        """What holds for the owner's later passes: the anchor only."""
        return MixPart(self.anchor_epoch, self.anchor_offsets)

    def to_json(self) -> dict[str, Any]:
        return {
            "anchor_epoch": self.anchor_epoch,
            "anchor_offsets": list(self.anchor_offsets),
            "resume": None if self.resume is None else [list(s) for s in self.resume],
            "hold": self.hold,
        }

    @classmethod
    def from_json(cls, value: Any) -> MixPart | None:
        """The part a pass state carries (``None``: no state was loaded)."""
        if value is None:
            return None
        if isinstance(value, MixPart):
            return value
        resume = value.get("resume")
        return cls(
            int(value["anchor_epoch"]),
            tuple(int(o) for o in value["anchor_offsets"]),
            None if resume is None else tuple((int(s), int(g)) for s, g in resume),
            None if value.get("hold") is None else int(value["hold"]),
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
