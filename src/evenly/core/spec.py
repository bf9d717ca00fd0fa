"""The pass: one epoch (or the rest of one) as a value fixed in the main process when it
starts, and sent to the DataLoader workers once.

A pass is owned by whoever starts it: ``evenly.DataLoader`` (which hands whole batches
over), or, when the dataset runs under another loader, the dataset itself (``set_epoch``
marks a pass start; each further pass of a worker is the next epoch).  Workers never
decide anything about the pass: they read their share of the plan the spec describes.

Pure Python: no torch, no I/O.

>>> spec = PassSpec(epoch=2, start=40, num_samples=100, batch_size=8, world_size=2, rank=1)
>>> PassSpec.decode(spec.encode()) == spec
True
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from evenly.errors import check_int

__all__ = ["PassSpec"]


@dataclass(frozen=True)
class PassSpec:
    """Everything a worker needs to read its share of one pass.

    Args:
        epoch: the epoch (keys the shuffle and the per-sample seeds).
        start: positions of the epoch's order consumed before this pass (a resume).
        num_samples: ``len(source)`` when the pass started (a worker whose copy of the
            source has another length raises).
        batch_size, drop_last: the plan's batch size (1 when the loader batches by itself)
            and remainder handling.
        rank, world_size: the data-parallel rank and group size, resolved in the main
            process (workers started with spawn/forkserver have no process group).
        handoff: workers yield whole collated batches (``evenly.DataLoader``) instead of
            single samples.
        generation: the dataset's generation (bumped when ``source`` or ``transform`` is
            replaced): a worker holding an older copy raises instead of reading stale data.
        infinite: batches over an endless stream of epochs (``start`` is then a stream
            position: ``epoch * num_samples + position``); see ``evenly.core.stream``.
        source: what the pass carries for a source that plans its own epochs (an
            ``evenly.Mix``: a loaded state's stream offsets and steps), JSON-serialisable.
    """

    epoch: int
    start: int
    num_samples: int
    batch_size: int = 1
    drop_last: bool = False
    rank: int = 0
    world_size: int = 1
    handoff: bool = False
    generation: int = 0
    infinite: bool = False
    source: Any = None

    def __post_init__(self) -> None:
        check_int("epoch", self.epoch, minimum=0)
        check_int("start", self.start, minimum=0)
        check_int("num_samples", self.num_samples, minimum=0)
        check_int("batch_size", self.batch_size, minimum=1)
        check_int("world_size", self.world_size, minimum=1)
        check_int("rank", self.rank, minimum=0)
        if self.rank >= self.world_size:
            raise ValueError(f"rank {self.rank} is out of range for world_size {self.world_size}")

    def encode(self) -> bytes:
        """The spec as JSON bytes (what the shared channel holds)."""
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes) -> PassSpec:
        return cls(**json.loads(data))
