"""HF Accelerate's ``skip_first_batches`` over an ``evenly.DataLoader``, made exact.

For a loader it did not wrap, Accelerate builds a ``SkipDataLoader`` from
``loader.dataset``: a torch DataLoader over the dataset (with the loader's batch size and
workers) that reads and drops the first ``k`` batches.  Left alone, that reads the
dataset's own passes (other batches than the evenly.DataLoader's), and after
``accelerator.load_state()`` (which already positioned the loader) it skips the received
batches a second time.

So while a ``SkipDataLoader`` iterates an evenly.DataLoader's dataset, the dataset serves
its owner's pass instead (a *delegated* pass):

- with a loaded state that positioned the owner, the rest of that pass, when ``k`` is the
  number of batches the state says were received (a clear error otherwise);
- without one, the owner's next pass from its ``k``-th batch on: the rest of the
  uninterrupted run.

The ``k`` batches the ``SkipDataLoader`` drops are not read: each worker yields filler
samples for its share of them (a copy of its first real sample), and its real samples
follow in the worker slots the ``SkipDataLoader``'s round-robin gives them, so the batches
it keeps are exactly the owner's.  The owner learns that the epoch was consumed (a shared
flag) and goes on with the next one.

Accelerate is never imported here: only looked up if the program already imported it;
what this relies on (``SkipDataLoader`` calls ``begin()``, so ``GradientState`` names it
while it runs, and its ``skip_batches``) is pinned by ``tests/test_accelerate_internals.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from evenly.core.spec import PassSpec
from evenly.core.state import PassState
from evenly.interop.accelerate import _active, _loaders, find_path

if TYPE_CHECKING:
    from evenly.core.passes import PassTracker
    from evenly.loader.loader import DataLoader
    from evenly.runtime.planner import Planner

__all__ = [
    "Delegation",
    "after_delegated",
    "delegate",
    "delegation_of",
    "read_delegated",
    "skipping",
]


def skipping(dataset: object) -> int | None:
    """The batches Accelerate's ``SkipDataLoader`` drops, if one is iterating ``dataset``
    in this process (what ``skip_first_batches`` builds for a loader it did not wrap)."""
    loaders, active = _loaders(), _active()
    skip = None if loaders is None else getattr(loaders, "SkipDataLoader", None)
    if skip is None or not isinstance(active, skip):
        return None
    if find_path(active, dataset) is None:
        return None
    return int(getattr(active, "skip_batches", 0))


@dataclass(frozen=True)
class Delegation:
    """The owner's pass a ``SkipDataLoader`` reads: from ``spec`` on, after ``k`` dropped
    batches (``first`` reads a filler sample where a worker has no real one); ``done``
    is the owner's shared flag (the epoch consumed)."""

    spec: PassSpec
    first: PassSpec
    k: int
    done: torch.Tensor


def delegation_of(dataset: Any) -> Delegation | None:
    """The owning evenly.DataLoader's pass, if a ``SkipDataLoader`` reads ``dataset``
    (an ``evenly.Dataset``) in this process now."""
    k = skipping(dataset) if dataset._owned else None
    owner = None if k is None or dataset._owner is None else dataset._owner()
    return None if k is None or owner is None else delegate(owner, k)


def delegate(owner: DataLoader, k: int) -> Delegation:
    """The delegated pass of ``owner`` under ``skip_first_batches(owner, k)``."""
    owner._follow_set_epoch()  # not the shared flag: a worker may have set it already
    planner = owner.dataset._planner
    start = owner._passes.next_start()
    if start.resumes:  # a loaded state positioned the owner
        if start.batches != k:
            raise RuntimeError(
                f"evenly: skip_first_batches(loader, {k}) over an evenly.DataLoader whose "
                f"loaded state says {start.batches} batch(es) of epoch {start.epoch} were "
                f"received: skipping {k} would lose or repeat samples. After "
                f"accelerator.load_state(), iterate the evenly.DataLoader itself (it "
                f"continues with the first batch not received), or skip exactly "
                f"{start.batches}"
            )
        rest = start
    else:
        epoch_start = owner._spec(start)
        plan = planner.plan_for(epoch_start)
        have = plan.rank_batches(epoch_start.rank)
        if k > have:
            raise ValueError(
                f"evenly: skip_first_batches(loader, {k}), but this rank has {have} "
                f"batch(es) in epoch {start.epoch}"
            )
        rest = _after(planner, owner, start, plan.consumed_after(k), k, plan.order) if k else start
    first = owner._spec(PassState(rest.epoch, 0, 0, owner._passes.next_start().source))
    return Delegation(owner._spec(rest), first, k, owner._delegated)


def _after(
    planner: Planner, owner: DataLoader, start: PassState, position: int, k: int, order: Any
) -> PassState:
    """The state after ``k`` batches of the pass from ``start`` (a Mix adds its part, as
    a checkpoint there would)."""
    saved = planner.to_state(PassState(start.epoch, position, k, start.source), owner._drop, order)
    return planner.from_state(saved, owner._drop)


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
            yield filler  # dropped by the SkipDataLoader, never seen by the loop
        if head is not None:
            yield head
    yield from samples


def after_delegated(passes: PassTracker, done: torch.Tensor) -> None:
    """In the owner (main process): if a delegated pass consumed the epoch its next pass
    would start, the next pass is the following epoch."""
    epoch = int(done[0])
    if epoch >= 0:
        done[0] = -1
        if passes.current is None and passes.next_start().epoch == epoch:
            passes.set_epoch(epoch + 1)
