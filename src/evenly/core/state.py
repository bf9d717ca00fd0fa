"""Checkpoint states: where an epoch stands, as a small JSON-serialisable dict.

Because every epoch's order is a pure function of (seed, epoch), and what all ranks have
consumed is always a prefix of that order, a position in training is two integers:
``epoch`` and ``position`` (how many positions of the epoch's order are consumed).  They
do not depend on the rank, the number of workers or the batch size, so a state saved
under one topology resumes exactly under another.

Format (version 3)::

    {"format": "evenly.state", "version": 3, "epoch": 3, "position": 40960,
     "batches": 80, "num_samples": 1000000, "seed": 0, "shuffle": "global",
     "drop_last": false, "pad": "repeat"}

``batches`` is how many batches this rank's loop had received in the interrupted epoch
(``len(loader)`` after a load counts them, as Lightning's restored batch counter and
StatefulDataLoader expect).  Version 1 states (evenly 0.1: no ``batches``) are migrated
with ``batches = 0``; they resume the same samples, but per-sample random draws changed
in version 2 (full-width NumPy seeding), so a resumed epoch's augmentations differ from
those the interrupted run would have drawn.  Version 2 states (no ``pad``) load as
``pad="repeat"``, the only mode there was.  Under packing (``evenly.Packing``) a state
also records ``seq_len``, ``strategy``, ``pad_id`` and ``unit: "rows"``, and ``position``
counts the epoch's packed rows.  Fields that later releases add to version 3
are optional, with the value that keeps a saved state's meaning.  A state stays
loadable by every evenly release that reads its version; an unknown version is refused
with an error, never guessed at.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from evenly.errors import StateError, check_int

__all__ = ["FORMAT", "VERSION", "PassState", "check_state"]

FORMAT = "evenly.state"
#: What a state records under packing (``position`` then counts rows).
PACKING = ("seq_len", "strategy", "pad_id", "unit")
VERSION = 3
#: Older versions this release migrates.
MIGRATED = (1, 2)
#: The plan fields a state must agree on with the dataset it is loaded into (the packing
#: fields are absent, so compared as ``None``, for a dataset that does not pack).
FINGERPRINT = ("num_samples", "seed", "shuffle", "drop_last", "pad", *PACKING)


@dataclass(frozen=True)
class PassState:
    """Where a pass starts, or where one stands: a prefix of one epoch's global order.

    ``position`` counts the epoch's positions consumed on all ranks, ``batches`` the
    batches this rank's loop had received in that epoch before ``position`` (0 at an
    epoch start), ``source`` a planned source's own part (an ``evenly.Mix``'s stream
    offsets and step history).  The same value for every owner of passes:
    ``evenly.DataLoader``, ``evenly.BatchSampler`` and the dataset's own passes.

    >>> state = PassState(epoch=2, position=40, batches=5)
    >>> saved = state.to_dict({"num_samples": 100, "seed": 0, "shuffle": "none",
    ...                        "drop_last": False})
    >>> PassState.from_dict(saved, {"num_samples": 100, "seed": 0, "shuffle": "none",
    ...                             "drop_last": False}) == state
    True
    """

    epoch: int = 0
    position: int = 0
    batches: int = 0
    source: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        check_int("epoch", self.epoch, minimum=0)
        check_int("position", self.position, minimum=0)
        check_int("batches", self.batches, minimum=0)

    @property
    def resumes(self) -> bool:
        """True for a state inside an epoch (a pass starting here continues one)."""
        return self.position > 0

    def to_dict(self, fingerprint: dict[str, Any]) -> dict[str, Any]:
        """The checkpoint dict: this state and the plan's ``fingerprint``."""
        state = {
            "format": FORMAT,
            "version": VERSION,
            "epoch": self.epoch,
            "position": self.position,
            "batches": self.batches,
            **fingerprint,
        }
        if self.source is not None:
            state["source_state"] = self.source
        return state

    @classmethod
    def from_dict(cls, state: object, fingerprint: dict[str, Any]) -> PassState:
        """Validate a checkpoint dict against ``fingerprint`` (every field that differs
        is named in one error, with the saved and current values)."""
        epoch, position, batches = check_state(state, fingerprint)
        assert isinstance(state, dict)  # checked above
        return cls(epoch, position, batches if position else 0, state.get("source_state"))


def check_state(state: object, fingerprint: dict[str, Any]) -> tuple[int, int, int]:
    """Validate ``state`` against the dataset's ``fingerprint``; return (epoch, position,
    batches received in that epoch).

    Every field that differs is named in one error, with the saved and current values.
    """
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise StateError(
            f"not an evenly state dict (expected a dict with format={FORMAT!r}); got "
            f"{type(state).__name__}"
            + (f" with keys {sorted(state)}" if isinstance(state, dict) else "")
        )
    version = state.get("version")
    if version == 1:  # no batches yet (and no pad)
        state = {**state, "batches": 0}
    if version in MIGRATED:  # version 2: the only pad mode was "repeat"
        state = {**state, "version": VERSION, "pad": state.get("pad", "repeat")}
    elif version != VERSION:
        raise StateError(
            f"unknown evenly state version {version!r}: this evenly reads versions "
            f"{[*MIGRATED, VERSION]}; load it with the evenly release that saved it"
        )
    mismatches = [
        f"{key}: saved {state.get(key)!r}, dataset has {fingerprint.get(key)!r}"
        for key in sorted(set(FINGERPRINT) | set(fingerprint))
        if state.get(key) != fingerprint.get(key)
    ]
    if mismatches:
        raise StateError(
            "this state was saved for a different plan, so resuming would repeat or skip "
            "samples; mismatched: " + "; ".join(mismatches)
        )
    epoch = check_int("state['epoch']", state.get("epoch"), minimum=0)
    position = check_int("state['position']", state.get("position"), minimum=0)
    batches = check_int("state['batches']", state.get("batches", 0), minimum=0)
    if fingerprint.get("unit") != "rows" and position > fingerprint["num_samples"]:
        raise StateError(
            f"state['position']={position} is past the end of the epoch "
            f"({fingerprint['num_samples']} samples)"
        )
    return epoch, position, batches
