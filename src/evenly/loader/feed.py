"""The pieces of a pass under ``evenly.DataLoader``: the feed (one worker's share of the
pass, one collated batch per item, in a worker process or a reader thread), the runners
of a pass (torch's DataLoader iterator with its worker hygiene, or reader threads), and
the iterator that counts what the training loop received."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
from torch.utils.data import IterableDataset, default_collate, get_worker_info

from evenly.core.passes import Pass
from evenly.core.plan import EpochPlan
from evenly.core.source import SourceView
from evenly.core.spec import PassSpec
from evenly.core.stream import StreamPlan
from evenly.loader.stats import PassRecorder
from evenly.runtime import torch_compat
from evenly.runtime.channel import PassChannel
from evenly.runtime.clock import StageClock, perf_counter
from evenly.runtime.hooks import PassWatcher
from evenly.runtime.planner import Planner
from evenly.transport.slots import Transport, plain_collate, unpack

__all__ = ["NO_LENGTH", "Feed", "PassIterator", "Runner", "TorchPass", "pass_through"]


def pass_through(item: Any) -> Any:
    """The private loader's collate: batches are collated in the workers already."""
    return item


class Runner(Protocol):
    """What runs one pass, each ``next()`` an ``(item, stage times)``: torch's DataLoader
    iterator (:class:`TorchPass`) or reader threads (``loader.threads.ThreadPass``)."""

    def __next__(self) -> Any: ...
    def settle(self) -> None: ...  # it ran to its end: wait until what it ran stopped
    def close(self) -> None: ...  # stop it, finished or abandoned (a new pass starts)
    def name_dead_workers(self, exc: BaseException) -> None: ...  # raise it, if any died


class TorchPass(Iterator[Any]):
    """One pass read by the private torch DataLoader, and the worker hygiene around its
    iterator (a documented fork-hang workaround; ``tests/test_torch_internals.py`` pins
    the private attributes it reads)."""

    def __init__(self, iterator: Iterator[Any]) -> None:
        self.iterator = iterator

    def __next__(self) -> Any:
        return next(self.iterator)

    def settle(self, shut_down: bool = False) -> None:
        """Wait until a finished iterator's queue feeder threads have exited.

        A Python thread that is exiting while the next epoch forks its workers can leave
        CPython's thread-state lock held in the child, which then hangs forever inside
        ``os.fork`` (seen with CPython 3.11: the new worker never starts, its rank waits
        for data and every other rank waits in a collective).  Torch closes those queues
        when an epoch ends but does not wait for their threads; evenly does, before any
        new fork.  With ``shut_down``, an iterator abandoned mid-epoch is shut down first.
        """
        inner = self.iterator
        if shut_down and not torch_compat.is_persistent(inner):
            torch_compat.shut_down_workers(inner)
        if not torch_compat.is_shut_down(inner):
            return
        for thread in torch_compat.index_queue_feeders(inner):
            thread.join(timeout=10)

    def close(self) -> None:
        self.settle(shut_down=True)

    def dead_workers(self, wait: float = 2.0) -> list[int]:
        """Pids of the workers that died (waiting briefly: a worker killed an instant ago
        closes its sockets a moment before it can be seen dead)."""
        workers = torch_compat.worker_processes(self.iterator)
        deadline = time.monotonic() + wait
        while True:
            dead = [w.pid for w in workers if not w.is_alive()]
            if dead or not workers or time.monotonic() > deadline:
                return dead
            time.sleep(0.02)

    def name_dead_workers(self, exc: BaseException) -> None:
        """Raise evenly's error naming the workers that died, if any did, with torch's
        error as the cause: a bare connection error (the worker died while the main
        process fetched its batch's shared memory), or torch's RuntimeError (its SIGCHLD
        handler's, or "exited unexpectedly" while waiting for data)."""
        handing_over = not isinstance(exc, RuntimeError)
        try:
            dead = self.dead_workers(wait=2.0 if handing_over else 0.0)
        except RuntimeError as signalled:  # torch's SIGCHLD handler, during that wait
            exc, dead = signalled, self.dead_workers(wait=0.0)
        if dead:
            when = "while handing over a batch" if handing_over else "during the epoch"
            raise RuntimeError(
                f"evenly: DataLoader worker(s) (pid {', '.join(map(str, dead))}) died "
                f"{when} (killed by a signal or out of memory?)"
            ) from exc


class Feed(IterableDataset[Any]):
    """What the private loader's workers iterate: their share of the pass published in
    the channel, one collated batch (or sample) per item (:meth:`share`)."""

    def __init__(
        self,
        planner: Planner,
        channel: PassChannel,
        collate: Callable[[Any], Any] | None,
        per_sample: Callable[[Any], Any] | None,
        skipped: torch.Tensor,
    ) -> None:
        self.planner = planner
        self.channel = channel
        self.collate = collate
        self.per_sample = per_sample
        self.skipped = skipped
        self.columnar = False
        #: the workers' shared-memory slots (None: torch's hand-off)
        self.transport: Transport | None = None

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        spec = self.channel.read()
        if spec is None:
            raise RuntimeError("evenly: a DataLoader worker found no pass to read (a bug)")
        if info is None:  # no workers: the main process reads the whole pass
            yield from self.share(spec, 0, 1, in_main=True)
            return
        pack = None
        if self.transport is not None:
            writer = self.transport.writer(info.id)
            writer.reclaim()
            pack = writer.pack
        yield from self.share(spec, info.id, info.num_workers, pack=pack)

    def share(
        self,
        spec: PassSpec,
        worker: int,
        workers: int,
        *,
        view: SourceView | None = None,
        pack: Callable[[Any], Any] | None = None,
        pin: bool = False,
        in_main: bool = False,
    ) -> Iterator[tuple[Any, Any]]:
        """Worker ``worker`` of ``workers``'s share of the pass ``spec``, each item with
        its stage times (``loader.stats()``): ``clock.take()``, or read ``in_main``
        process (no workers) the clock itself, which the stats read.  ``view``: the
        source to read (a reader thread's own copy); ``pack``: packs each item into the
        worker's shared-memory slot; ``pin``: pins each item's memory."""
        collate = self.collate
        if pack is not None and collate is default_collate:
            collate = plain_collate  # stacked outside shared memory, then packed once
        clock = StageClock()
        items = self.planner.read(
            spec,
            worker,
            workers,
            collate=collate,
            columnar=self.columnar,
            skipped=self.skipped,
            view=view,
            clock=clock,
            checked=True,  # the loader's main process checked at the pass start
        )
        if self.per_sample is not None:
            items = map(self.per_sample, items)
        if pin:
            items = map(torch_compat.pin_memory, items)
        if in_main:
            for item in items:
                yield item, clock
            return
        take = clock.take
        if pack is None:
            for item in items:
                yield item, take()
        else:
            for item in items:
                started = perf_counter()
                packed = pack(item)
                clock.handoff += perf_counter() - started
                yield packed, take()


class PassIterator(Iterator[Any]):
    """Counts the batches handed to the training loop (not those prefetched)."""

    def __init__(
        self,
        inner: Runner,
        current: Pass,
        plan: EpochPlan | StreamPlan,
        on_end: Callable[[EpochPlan], None] | None,
    ) -> None:
        self._inner = inner
        self._pass = current
        self._plan = plan
        self._on_end = on_end
        #: the pass's figures for ``loader.stats()`` (set by the loader)
        self.recorder: PassRecorder | None = None
        #: what Accelerate's GradientState reads of this pass (set by the loader)
        self.epoch_end: PassWatcher | None = None

    @property
    def inner(self) -> Runner:
        """What runs the pass (torch's DataLoader iterator, or reader threads)."""
        return self._inner

    def adopt(self, other: PassIterator) -> None:
        """Go on with ``other``'s pass (a restart at the position reached, as
        ``set_weights`` does): the training loop keeps iterating this object."""
        self._inner, self._pass, self._plan, self._on_end = (
            other._inner,
            other._pass,
            other._plan,
            other._on_end,
        )
        if other.epoch_end is not None:  # this object stays the one Accelerate follows
            other.epoch_end.leave()
            if self.epoch_end is not None:
                self.epoch_end.remainder = other.epoch_end.remainder

    def __iter__(self) -> PassIterator:
        return self

    def __next__(self) -> Any:
        recorder = self.recorder
        started = perf_counter()
        if recorder is not None and recorder.started is None:
            recorder.started = started
        try:
            item, times = next(self._inner)
            got = perf_counter()
            batch = unpack(item)
        except (ConnectionError, EOFError, RuntimeError) as exc:
            self._inner.name_dead_workers(exc)
            raise
        except StopIteration:
            if not self._pass.finished:
                self._pass.finished = True
                self._inner.settle()
                if self._on_end is not None and isinstance(self._plan, EpochPlan):
                    self._on_end(self._plan)
                if recorder is not None:
                    recorder.end(started)
            if self.epoch_end is not None:
                self.epoch_end.leave()
            raise
        self._pass.received += 1
        if self.epoch_end is not None and self._pass.remaining == 0:
            self.epoch_end.last()
        if recorder is not None:
            recorder.add(times, started, got, batch is not item)
        return batch

    def __len__(self) -> int:
        if self._pass.total is None:
            raise TypeError(NO_LENGTH)
        return self._pass.prior + self._pass.total


NO_LENGTH = (
    "an evenly.DataLoader(..., infinite=True) has no length: it runs across epochs "
    "until the loop stops; count steps (loader.epoch and loader.state_dict() say where "
    "it stands)"
)
