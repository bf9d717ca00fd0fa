"""The private torch attributes that ``evenly.loader.feed.settle`` (the fork-hang workaround)
reads, checked on a real multi-worker DataLoader iterator.

``settle`` reads them with ``getattr`` and a default, so a torch release that renamed one
would turn the workaround into a silent no-op (and bring the CPython 3.11 fork hang back):
these tests fail instead.  What it relies on:

- ``_persistent_workers``: the loader's ``persistent_workers``;
- ``_shutdown``: False while the workers run, True once they were shut down;
- ``_shutdown_workers()``: stops the workers and closes the index queues, mid-epoch too;
- ``_index_queues``: one ``multiprocessing`` queue per worker, whose ``_thread`` is its
  feeder thread (``settle`` joins it before anything forks again);
- ``_workers``: the worker processes.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info


class Numbers(IterableDataset[int]):
    """0..n-1, split between the workers."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        info = get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        return iter(range(start, self.n, step))


def _loader(persistent: bool) -> DataLoader[Any]:
    return DataLoader(Numbers(40), batch_size=4, num_workers=2, persistent_workers=persistent)


def _check_running(it: Any, persistent: bool) -> None:
    assert it._persistent_workers is persistent
    assert it._shutdown is False
    workers = it._workers
    assert len(workers) == 2
    assert all(w.is_alive() and isinstance(w.pid, int) and w.pid != os.getpid() for w in workers)
    queues = it._index_queues
    assert len(queues) == 2
    for q in queues:
        # Indices were put already (prefetch), so each queue's feeder thread is running.
        assert isinstance(q._thread, threading.Thread), type(q._thread)
        assert q._thread.is_alive()
    assert callable(it._shutdown_workers)


def _check_shut_down(it: Any, feeders: list[threading.Thread]) -> None:
    assert it._shutdown is True
    assert not any(w.is_alive() for w in it._workers)
    for q, thread in zip(it._index_queues, feeders, strict=True):
        assert q._closed  # closed queue: its feeder thread ends...
        thread.join(timeout=60)  # ...which is what settle() waits for
        assert not thread.is_alive()


def test_a_non_persistent_iterator_shuts_down_at_the_end_of_the_epoch() -> None:
    it: Any = iter(_loader(persistent=False))
    assert type(it).__name__ == "_MultiProcessingDataLoaderIter"
    first = next(it)
    _check_running(it, persistent=False)
    feeders = [q._thread for q in it._index_queues]
    rest = list(it)
    assert sorted(torch.cat([first, *rest]).tolist()) == list(range(40))
    _check_shut_down(it, feeders)


def test_shutdown_workers_stops_a_non_persistent_iterator_mid_epoch() -> None:
    it: Any = iter(_loader(persistent=False))
    next(it)
    _check_running(it, persistent=False)
    feeders = [q._thread for q in it._index_queues]
    it._shutdown_workers()
    _check_shut_down(it, feeders)


def test_a_persistent_iterator_keeps_its_workers_between_epochs() -> None:
    loader = _loader(persistent=True)
    it: Any = iter(loader)
    next(it)
    _check_running(it, persistent=True)
    pids = [w.pid for w in it._workers]
    list(it)
    # Epoch over: nothing shut down, so settle() must not wait on these queues.
    assert it._shutdown is False
    assert all(w.is_alive() for w in it._workers)
    again: Any = iter(loader)
    assert again is it  # the same iterator, reset: the same worker processes
    assert [w.pid for w in again._workers] == pids
    assert sorted(torch.cat(list(again)).tolist()) == list(range(40))
    feeders = [q._thread for q in it._index_queues]
    it._shutdown_workers()
    _check_shut_down(it, feeders)


@pytest.mark.parametrize("persistent", [False, True])
def test_settle_reads_only_attributes_that_exist(persistent: bool) -> None:
    """Every name ``settle`` looks up is there (a rename would make it a no-op)."""
    it: Any = iter(_loader(persistent))
    next(it)
    for name in ("_persistent_workers", "_shutdown_workers", "_shutdown", "_index_queues"):
        assert hasattr(it, name), name
    assert all(hasattr(q, "_thread") for q in it._index_queues)
    assert hasattr(it, "_workers")
    it._shutdown_workers()


def test_a_persistent_loader_holds_its_iterator_in_iterator() -> None:
    """evenly.DataLoader restarts stale persistent workers by shutting down and dropping
    the private loader's ``_iterator``: it must be the live, reused iterator."""
    loader: Any = _loader(True)
    it = iter(loader)
    assert loader._iterator is it
    list(it)
    assert iter(loader) is loader._iterator is it
    it._shutdown_workers()
    loader._iterator = None
    fresh = iter(loader)
    assert fresh is not it and sorted(torch.cat(list(fresh)).tolist()) == list(range(40))
    fresh._shutdown_workers()
