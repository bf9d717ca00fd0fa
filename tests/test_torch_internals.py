"""Every private torch attribute evenly touches, all behind ``evenly.runtime.torch_compat``,
checked on a real multi-worker DataLoader (or a real process group).

The iterator functions read with ``getattr`` and a default, so a torch release that
renamed one would turn the fork-hang workaround (``evenly.loader.feed.TorchPass.settle``)
into a silent no-op and bring the CPython 3.11 fork hang back: these tests fail instead.
What evenly relies on, function by function:

- ``is_persistent`` (``_persistent_workers``): the loader's ``persistent_workers``;
- ``is_shut_down`` (``_shutdown``): False while the workers run, True once shut down;
- ``shut_down_workers`` (``_shutdown_workers()``): stops the workers and closes the index
  queues, mid-epoch too;
- ``index_queue_feeders`` (``_index_queues``, each queue's ``_thread``): one
  ``multiprocessing`` queue per worker and its feeder thread (``settle`` joins it before
  anything forks again);
- ``worker_processes`` (``_workers``): the worker processes;
- ``running_iterator`` / ``drop_iterator`` (the loader's ``_iterator``): the live,
  reused iterator of persistent workers, and forgetting it;
- ``default_collate_fn_map`` / ``collate_with`` (``torch.utils.data._utils.collate``);
- ``pin_memory`` (``torch.utils.data._utils.pin_memory.pin_memory``);
- ``default_store`` (``distributed_c10d._get_default_store``).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset, default_collate, get_worker_info

from evenly.runtime import torch_compat


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
    # the same facts through torch_compat
    assert torch_compat.is_persistent(it) is persistent
    assert torch_compat.is_shut_down(it) is False
    assert torch_compat.worker_processes(it) == workers
    assert torch_compat.index_queue_feeders(it) == [q._thread for q in queues]


def _check_shut_down(it: Any, feeders: list[threading.Thread]) -> None:
    assert it._shutdown is True
    assert torch_compat.is_shut_down(it) is True
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
    feeders = torch_compat.index_queue_feeders(it)
    torch_compat.shut_down_workers(it)
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


def test_an_iterator_without_workers_gets_the_defaults() -> None:
    """Without workers torch's iterator has none of the worker attributes: the functions
    answer "nothing to shut down or wait for"."""
    it: Any = iter(DataLoader(Numbers(8), batch_size=4, num_workers=0))
    assert type(it).__name__ == "_SingleProcessDataLoaderIter"
    for name in ("_shutdown_workers", "_shutdown", "_index_queues", "_workers"):
        assert not hasattr(it, name), name
    torch_compat.shut_down_workers(it)  # nothing to do
    assert torch_compat.is_shut_down(it) is False
    assert torch_compat.index_queue_feeders(it) == []
    assert torch_compat.worker_processes(it) == []
    assert sorted(torch.cat(list(it)).tolist()) == list(range(8))


def test_a_persistent_loader_holds_its_iterator_in_iterator() -> None:
    """evenly.DataLoader restarts stale persistent workers by shutting down and dropping
    the private loader's ``_iterator``: it must be the live, reused iterator."""
    loader: Any = _loader(True)
    assert torch_compat.running_iterator(loader) is None  # before the first iter()
    it = iter(loader)
    assert loader._iterator is it
    assert torch_compat.running_iterator(loader) is it
    list(it)
    assert iter(loader) is loader._iterator is it
    torch_compat.shut_down_workers(it)
    torch_compat.drop_iterator(loader)
    assert loader._iterator is None and torch_compat.running_iterator(loader) is None
    fresh = iter(loader)
    assert fresh is not it and sorted(torch.cat(list(fresh)).tolist()) == list(range(40))
    assert torch_compat.running_iterator(loader) is fresh
    fresh._shutdown_workers()


class Sized(IterableDataset[int]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        yield from range(self.n)


def test_len_answered_is_the_last_len_of_an_iterable_datasets_loader() -> None:
    """``len(loader)`` over an iterable dataset records ``len(dataset)`` on the loader
    (``_IterableDataset_len_called``): how evenly's Accelerate adapter sees, at a pass
    start, what an earlier ``len()`` counted."""
    dataset = Sized(10)
    loader = DataLoader(dataset, batch_size=4)
    assert torch_compat.len_answered(loader) is None  # never asked
    assert len(loader) == 3
    assert torch_compat.len_answered(loader) == 10
    dataset.n = 12
    assert len(loader) == 3 and torch_compat.len_answered(loader) == 12  # the last answer
    assert torch_compat.len_answered(DataLoader(list(range(5)))) is None  # map-style


def test_collate_with_is_default_collate_with_another_table() -> None:
    """``collate_with(batch, default_collate_fn_map())`` is ``default_collate``; an entry
    for a type replaces how it is collated, called with ``collate_fn_map=`` (how
    ``plain_collate`` stacks tensors outside shared memory)."""
    samples = [{"a": torch.ones(2) * i, "b": (i, "s"), "c": float(i)} for i in range(3)]
    table = torch_compat.default_collate_fn_map()
    got, want = torch_compat.collate_with(samples, table), default_collate(samples)
    assert got.keys() == want.keys() and torch.equal(got["a"], want["a"])
    assert got["b"][0].tolist() == want["b"][0].tolist() and got["b"][1] == want["b"][1]
    calls: list[Any] = []

    def stack(batch: Any, *, collate_fn_map: Any = None) -> Any:
        calls.append(collate_fn_map)
        return torch.stack(list(batch))

    table[torch.Tensor] = stack
    torch_compat.collate_with(samples, table)
    assert calls == [table]
    from torch.utils.data._utils.collate import default_collate_fn_map

    assert default_collate_fn_map[torch.Tensor] is not stack  # a copy was extended


def test_pin_memory_replaces_an_object_that_pins_itself() -> None:
    """Torch's pin step hands an object with a ``pin_memory`` method to that method (a
    packed batch of ``evenly.transport.slots`` unpacks itself there), inside containers
    too.  CPU-only torch cannot pin a tensor, so only that part is checked."""

    class Pins:
        def pin_memory(self, device: Any = None) -> str:
            return "pinned"

    assert torch_compat.pin_memory(Pins()) == "pinned"
    assert torch_compat.pin_memory({"a": Pins(), "b": [Pins(), "s"]}) == {
        "a": "pinned",
        "b": ["pinned", "s"],
    }


def test_default_store_is_the_default_groups_shared_store() -> None:
    """A ``Store`` over the one the default group was made with, supporting what the plan
    exchange calls: set, check, wait, get, delete_key."""
    from datetime import timedelta

    base = dist.HashStore()
    dist.init_process_group("gloo", store=base, rank=0, world_size=1)
    try:
        store = torch_compat.default_store()
        assert isinstance(store, dist.Store)
        before = base.num_keys()
        store.set("evenly/pin", "1")
        assert base.num_keys() == before + 1  # written through to the group's store
        other = torch_compat.default_store()
        other.wait(["evenly/pin"], timedelta(seconds=5))
        assert other.check(["evenly/pin"]) and other.get("evenly/pin") == b"1"
        assert other.delete_key("evenly/pin") and not store.check(["evenly/pin"])
    finally:
        dist.destroy_process_group()


class _Seeds(torch.utils.data.IterableDataset[tuple[int, int]]):
    """Yields (worker id, base seed) once per worker."""

    def __iter__(self) -> Iterator[tuple[int, int]]:
        info = torch.utils.data.get_worker_info()
        assert info is not None
        yield info.id, torch_compat.worker_base_seed(info)


@pytest.mark.parametrize("persistent", [False, True])
def test_every_worker_of_one_iterator_has_the_same_base_seed(persistent: bool) -> None:
    """``worker_base_seed`` (seed - id) is one value for all workers of an iterator (the
    key of the dataset's own passes), and a new one for a new iterator of a loader whose
    workers are not persistent."""
    loader = torch.utils.data.DataLoader(
        _Seeds(), batch_size=None, num_workers=3, persistent_workers=persistent
    )
    first = dict(loader)
    second = dict(loader)
    assert sorted(first) == sorted(second) == [0, 1, 2]
    assert len(set(first.values())) == 1 and len(set(second.values())) == 1
    assert (first == second) == persistent
