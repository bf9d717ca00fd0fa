"""Recognising the framework wrappers that rebuild a loader around an ``evenly.Dataset``.

HF Accelerate's ``prepare()`` (and so the HF Trainer) rebuilds a DataLoader from
``loader.dataset`` and either has rank 0 read for everyone (``DataLoaderDispatcher``,
the default for iterable datasets) or re-splits each rank's stream
(``IterableDatasetShard`` with ``dispatch_batches=False``).  Either would shard evenly's
already-sharded data a second time.  Both wrappers call ``dataset.set_epoch`` in the
main process, on every rank, before their workers start; at that moment Accelerate's
``GradientState`` names the wrapper being iterated, so the dataset can adapt:

- under the dispatcher, rank 0 plans the whole epoch alone (one rank) and the wrapper
  deals the batches to the ranks;
- under the shard wrapper, the wrapper is told to pass everything through (one process,
  batches of one), and evenly's own rank split applies.

Accelerate is never imported here: only looked up if the program already imported it.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from types import FrameType
from typing import Any

__all__ = ["Wrapped", "accelerate_wrapper", "resharded_in_worker"]


@dataclass(frozen=True)
class Wrapped:
    """How a framework wrapper drives the dataset: ``mode`` is "dispatch" or "shard";
    ``batch_size`` the wrapper's per-rank batch size (whole batches go to one worker)."""

    mode: str
    batch_size: int


def _gradient_state_loader() -> Any:
    state = sys.modules.get("accelerate.state")
    if state is None:
        return None
    try:
        return state.GradientState().active_dataloader
    except Exception:  # accelerate not initialised in this process
        return None


def accelerate_wrapper(dataset: object, *, search_stack: bool = False) -> Wrapped | None:
    """The Accelerate wrapper iterating ``dataset`` right now, if any (main process).

    ``set_epoch`` finds it in Accelerate's ``GradientState``; ``len()`` (which the HF
    Trainer and the wrappers call before iterating) finds it on the call stack.
    """
    loaders = sys.modules.get("accelerate.data_loader")
    if loaders is None:
        return None
    candidates = [_gradient_state_loader()]
    if search_stack:
        frame: FrameType | None = sys._getframe(1)
        for _ in range(16):
            if frame is None:
                break
            candidates.append(frame.f_locals.get("self"))
            frame = frame.f_back
    shard = getattr(loaders, "IterableDatasetShard", None)
    for active in candidates:
        if active is None:
            continue
        if shard is not None and isinstance(active, shard) and active.dataset is dataset:
            return _pass_through(active, 1)
        inner = getattr(active, "dataset", None)
        batch = getattr(active, "batch_size", None)
        batch = batch if isinstance(batch, int) and batch > 0 else 1
        if isinstance(active, loaders.DataLoaderDispatcher) and inner is dataset:
            return Wrapped("dispatch", batch)
        if shard is not None and isinstance(inner, shard) and inner.dataset is dataset:
            return _pass_through(inner, batch)
    return None


def _pass_through(shard: Any, batch: int) -> Wrapped:
    """Make Accelerate's IterableDatasetShard pass everything through: evenly already
    gives this rank exactly its share."""
    size = shard.batch_size if isinstance(shard.batch_size, int) and shard.batch_size > 1 else batch
    shard.num_processes, shard.process_index, shard.batch_size = 1, 0, 1
    shard.drop_last = False
    return Wrapped("shard", max(1, size))


def resharded_in_worker(dataset: object, worker_dataset: object) -> str | None:
    """In a DataLoader worker: a description of a wrapper that would split this rank's
    share again (Accelerate's IterableDatasetShard not neutralised), else None."""
    if worker_dataset is dataset or getattr(worker_dataset, "dataset", None) is not dataset:
        return None
    processes = getattr(worker_dataset, "num_processes", 1)
    if isinstance(processes, int) and processes > 1:
        return (
            f"{type(worker_dataset).__name__}(num_processes={processes}) wraps this "
            f"evenly.Dataset and would split each rank's share again"
        )
    return None
