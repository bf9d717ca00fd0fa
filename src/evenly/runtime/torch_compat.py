"""Every private torch attribute or module evenly touches, one small function each.

Torch keeps these out of its public API, so a release may rename or change any of them;
each function here says what it assumes and the torch version it was checked against,
and ``tests/test_torch_internals.py`` pins each one on a real DataLoader with real
workers (or a real process group), so a change fails there instead of silently turning
a workaround into a no-op.  Nothing else in evenly reads a private torch name.

Checked against torch 2.13.0.  Torch is imported lazily: importing this module loads
nothing.

>>> import torch
>>> collate_with([torch.tensor(1), torch.tensor(2)], default_collate_fn_map()).tolist()
[1, 2]
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

__all__ = [
    "collate_with",
    "default_collate_fn_map",
    "default_store",
    "drop_iterator",
    "index_queue_feeders",
    "is_persistent",
    "is_shut_down",
    "len_answered",
    "pin_memory",
    "running_iterator",
    "shut_down_workers",
    "worker_base_seed",
    "worker_processes",
]

# ---- a DataLoader and its iterator (torch.utils.data.dataloader) ----------------------


def running_iterator(loader: Any) -> Any | None:
    """The iterator a ``DataLoader`` with ``persistent_workers=True`` keeps and resets at
    every ``iter()`` (``loader._iterator``); ``None`` before the first ``iter()``, after
    :func:`drop_iterator`, and always without persistent workers.  Checked: torch 2.13.0.
    """
    return getattr(loader, "_iterator", None)


def drop_iterator(loader: Any) -> None:
    """Forget the kept iterator (``loader._iterator = None``): the next ``iter()`` starts
    new workers.  Shut the old ones down first (:func:`shut_down_workers`).  Checked:
    torch 2.13.0."""
    loader._iterator = None


def len_answered(loader: Any) -> int | None:
    """The answer of the last ``len(loader)`` over an iterable dataset: ``len(dataset)``,
    which ``DataLoader.__len__`` records (``loader._IterableDataset_len_called``; torchdata's
    ``StatefulDataLoader`` too); ``None`` if ``len()`` was never asked.  Checked: torch
    2.13.0, torchdata 0.11.0."""
    answered = (
        vars(loader).get("_IterableDataset_len_called") if hasattr(loader, "__dict__") else None
    )
    return answered if isinstance(answered, int) else None


def is_persistent(iterator: Any) -> bool:
    """Whether a multi-worker iterator keeps its workers after the epoch
    (``_persistent_workers``, the loader's ``persistent_workers``); True for an iterator
    without it (one without workers has nothing to shut down).  Checked: torch 2.13.0."""
    return bool(getattr(iterator, "_persistent_workers", True))


def shut_down_workers(iterator: Any) -> None:
    """Stop a multi-worker iterator's workers and close its index queues, mid-epoch too
    (``_shutdown_workers()``; nothing for an iterator without workers).  Checked: torch
    2.13.0."""
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()


def is_shut_down(iterator: Any) -> bool:
    """Whether the iterator's workers were shut down (``_shutdown``: False while they run,
    True after the last batch of a non-persistent epoch or :func:`shut_down_workers`);
    False for an iterator without workers.  Checked: torch 2.13.0."""
    return bool(getattr(iterator, "_shutdown", False))


def index_queue_feeders(iterator: Any) -> list[threading.Thread]:
    """The feeder threads of the iterator's per-worker index queues (``_index_queues``:
    one ``multiprocessing`` queue per worker, each with its feeder thread ``_thread``
    once something was put; a closed queue's thread ends on its own).  Checked: torch
    2.13.0, CPython 3.11."""
    threads = (getattr(q, "_thread", None) for q in getattr(iterator, "_index_queues", []))
    return [t for t in threads if t is not None]


def worker_processes(iterator: Any) -> list[Any]:
    """The iterator's worker processes (``_workers``: ``multiprocessing`` processes with
    ``pid`` and ``is_alive()``); empty without workers.  Checked: torch 2.13.0."""
    return list(getattr(iterator, "_workers", []))


# ---- collate and pin memory (torch.utils.data._utils) ---------------------------------


def default_collate_fn_map() -> dict[Any, Callable[..., Any]]:
    """A copy of ``default_collate``'s type -> function table
    (``torch.utils.data._utils.collate.default_collate_fn_map``), to extend for
    :func:`collate_with`.  Checked: torch 2.13.0."""
    from torch.utils.data._utils.collate import default_collate_fn_map as table

    return dict(table)


def collate_with(batch: Any, fn_map: dict[Any, Callable[..., Any]]) -> Any:
    """``default_collate``'s recursion with the given type -> function table
    (``torch.utils.data._utils.collate.collate``: each function is called as
    ``fn(batch, collate_fn_map=fn_map)``).  Checked: torch 2.13.0."""
    from torch.utils.data._utils.collate import collate

    return collate(batch, collate_fn_map=fn_map)


def pin_memory(data: Any, device: Any = None) -> Any:
    """What torch's pin-memory thread does to a batch
    (``torch.utils.data._utils.pin_memory.pin_memory``: tensors pinned inside dicts,
    lists and tuples; an object with a ``pin_memory`` method is replaced by what it
    returns).  Looked up at each call.  Checked: torch 2.13.0."""
    from torch.utils.data._utils import pin_memory as pinning

    return pinning.pin_memory(data, device)  # type: ignore[no-untyped-call]


# ---- torch.distributed -----------------------------------------------------------------


def default_store() -> Any:
    """The default process group's store (``distributed_c10d._get_default_store()``): a
    ``torch.distributed.Store`` (a ``PrefixStore`` over the store the group was made
    with) that every rank of the default group shares.  Checked: torch 2.13.0."""
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


def worker_base_seed(worker: Any) -> int:
    """The base seed shared by every worker of one DataLoader iterator: torch seeds worker
    ``i`` with ``base_seed + i`` (``_MultiProcessingDataLoaderIter``), and
    ``get_worker_info()`` reports that seed and ``i``."""
    return int(worker.seed) - int(worker.id)
