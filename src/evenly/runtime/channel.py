"""Shared memory between the main process and DataLoader workers (persistent ones too,
and ones started with spawn or forkserver, which receive the tensors by handle).

:class:`PassChannel` holds the spec of the pass in progress, published by its owner in
the main process before the workers are asked for data.
"""

from __future__ import annotations

import torch

from evenly.core.spec import PassSpec

__all__ = ["PassChannel"]


def _shared(values: list[int]) -> torch.Tensor:
    shared: torch.Tensor = torch.tensor(values, dtype=torch.int64).share_memory_()  # type: ignore[no-untyped-call]
    return shared


class PassChannel:
    """One pass spec in shared memory (slot 0 says whether one was published)."""

    def __init__(self) -> None:
        self._slots = _shared([0] * (1 + PassSpec.size()))

    def publish(self, spec: PassSpec) -> None:
        self._slots[1:] = torch.tensor(spec.encode(), dtype=torch.int64)
        self._slots[0] = 1

    def read(self) -> PassSpec | None:
        values = self._slots.tolist()
        return PassSpec.decode(values[1:]) if values[0] else None
