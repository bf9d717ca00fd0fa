"""A *delegated* pass: another loader reads an ``evenly.DataLoader``'s pass through its
dataset (HF Accelerate's ``skip_first_batches`` builds a loader from ``loader.dataset``
that reads and drops the first ``k`` batches).

The dataset serves its owner's pass instead of one of its own: the owner plans it
(:class:`PassOwner`, ``evenly.DataLoader._delegated_pass``), each worker reads it here.
The ``k`` dropped batches are not read: each worker yields filler samples for its share
of them (a copy of its first real sample), and its real samples follow in the worker
slots the other loader's round-robin gives them, so the batches it keeps are exactly the
owner's.  The owner learns that the epoch was consumed through a shared flag.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from evenly.core.spec import PassSpec

if TYPE_CHECKING:
    from evenly.runtime.planner import Planner

__all__ = ["Delegation", "PassOwner", "read_delegated"]


@dataclass(frozen=True)
class Delegation:
    """The owner's pass another loader reads: from ``spec`` on, after ``k`` dropped
    batches (``first`` reads a filler sample where a worker has no real one); ``done``
    is the owner's shared flag (the epoch consumed)."""

    spec: PassSpec
    first: PassSpec
    k: int
    done: torch.Tensor


class PassOwner(Protocol):
    """What a dataset needs of the loader that owns its passes (``evenly.DataLoader``)."""

    def _delegated_pass(self, k: int) -> Delegation:
        """The owner's pass as read by a loader that drops its first ``k`` batches."""
        ...


def read_delegated(
    planner: Planner, delegation: Delegation, worker_id: int, num_workers: int, **kw: Any
) -> Iterator[Any]:
    """This worker's samples of the delegated pass: fillers for its share of the ``k``
    dropped batches, then its real samples (the owner's batches ``i`` with
    ``(k + i) % num_workers == worker_id``)."""
    spec, k = delegation.spec, delegation.k
    delegation.done[0] = spec.epoch
    fillers = len(range(worker_id, k, num_workers)) * spec.batch_size
    samples = planner.read(spec, (worker_id - k) % num_workers, num_workers, **kw)
    if fillers:
        head = next(samples, None)
        filler = head
        if filler is None:  # no real sample on this worker: read one of the epoch's
            filler = next(planner.read(delegation.first, 0, 1, **kw))
        for _ in range(fillers):
            yield filler  # dropped by the other loader, never seen by the loop
        if head is not None:
            yield head
    yield from samples
