"""Where this process sits: its global rank and the world size.

Explicit arguments win; then an initialised ``torch.distributed``; then the ``RANK`` and
``WORLD_SIZE`` variables that torchrun sets; then a single process.  ``LOCAL_RANK`` is
never used: it repeats on every node, so splitting data by it duplicates samples.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ._plan import check_int

__all__ = ["Topology", "detect_topology"]


@dataclass(frozen=True)
class Topology:
    """This process's global ``rank`` among ``world_size`` ranks."""

    rank: int = 0
    world_size: int = 1

    def __post_init__(self) -> None:
        check_int("world_size", self.world_size, minimum=1)
        check_int("rank", self.rank, minimum=0)
        if self.rank >= self.world_size:
            raise ValueError(
                f"rank {self.rank} is out of range for world_size {self.world_size}: "
                f"rank must lie in [0, {self.world_size - 1}]"
            )


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


def detect_topology(rank: int | None = None, world_size: int | None = None) -> Topology:
    """Resolve (rank, world_size); explicit arguments override what is detected."""
    detected_rank, detected_world = 0, 1
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        detected_rank, detected_world = dist.get_rank(), dist.get_world_size()
    else:
        env_rank, env_world = _env_int("RANK"), _env_int("WORLD_SIZE")
        if env_world is not None:
            detected_world = env_world
            detected_rank = env_rank if env_rank is not None else 0
    return Topology(
        rank=detected_rank if rank is None else rank,
        world_size=detected_world if world_size is None else world_size,
    )
