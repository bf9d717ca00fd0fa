"""Shared memory between the main process and DataLoader workers (persistent ones too,
and ones started with spawn or forkserver, which receive the tensors by handle).

- :class:`PassChannel`: the spec of the pass in progress, published by its owner in the
  main process before the workers are asked for data.
- :class:`PassCounter`: how many passes each worker of a loader the dataset does not
  own has started since the last ``set_epoch``, so that epochs advance by themselves.
"""

from __future__ import annotations

import torch

from evenly.core.spec import PassSpec

__all__ = ["MAX_WORKERS", "PassChannel", "PassCounter"]

#: Workers per rank that a dataset iterated by another loader can count.
MAX_WORKERS = 1024


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


class PassCounter:
    """Per-worker pass counts and the base they count from (epoch, start)."""

    def __init__(self) -> None:
        self._base = _shared([0, 0])  # epoch, start of the first pass after set_epoch
        self._counts = _shared([0] * MAX_WORKERS)

    def reset(self, epoch: int, start: int) -> None:
        """The next pass of every worker is ``epoch`` from ``start``."""
        self._base[0] = epoch
        self._base[1] = start
        self._counts.zero_()

    def rebase(self, worker_id: int, epoch: int, start: int) -> None:
        """A worker restored from a state (every worker of the loader loads the same
        epoch and start): its next pass is ``epoch`` from ``start``."""
        self._base[0] = epoch
        self._base[1] = start
        self._counts[worker_id] = 0

    def base(self) -> tuple[int, int]:
        epoch, start = self._base.tolist()
        return int(epoch), int(start)

    def begin(self, worker_id: int, num_workers: int) -> tuple[int, int]:
        """Count a pass of ``worker_id``; return its (epoch, start)."""
        if num_workers > MAX_WORKERS:
            raise ValueError(
                f"evenly counts passes for at most {MAX_WORKERS} DataLoader workers per rank, "
                f"got num_workers={num_workers}"
            )
        done = int(self._counts[worker_id])
        self._counts[worker_id] = done + 1
        epoch, start = self.base()
        return (epoch, start) if done == 0 else (epoch + done, 0)

    def current(self) -> tuple[int, int]:
        """(epoch, start) of the pass in progress (or the next one if none started)."""
        done = int(self._counts.max())
        epoch, start = self.base()
        if done <= 1:
            return epoch, start
        return epoch + done - 1, 0

    def started(self) -> int:
        """Passes started since the last reset (by the most advanced worker)."""
        return int(self._counts.max())
