"""Topology as a value: this process's data-parallel rank among ``world_size`` ranks.
Reading it from the environment is :mod:`evenly.runtime.detect`'s job."""

from __future__ import annotations

from dataclasses import dataclass

from evenly.errors import check_int

__all__ = ["Topology"]


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
