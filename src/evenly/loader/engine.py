"""The engine under ``evenly.DataLoader``: a private torch DataLoader over the feed, its
workers and their shared-memory slots.  The loader owns the passes; the engine runs one:
it publishes the pass spec, restarts persistent workers that hold a stale dataset, gives
workers that are about to start fresh slots (or, on the thread path, starts reader
threads over their own source copies), and hands back the iterator that counts what the
loop received."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import torch
import torch.utils.data
from torch.utils.data import default_collate, default_convert

from evenly.core.passes import Pass
from evenly.core.plan import EpochPlan
from evenly.core.source import SourceView
from evenly.core.spec import PassSpec
from evenly.core.stream import StreamPlan
from evenly.loader.feed import Feed, PassIterator, pass_through, settle
from evenly.loader.threads import ThreadPass, thread_copy
from evenly.runtime import torch_compat
from evenly.runtime.channel import PassChannel
from evenly.runtime.clock import StageClock
from evenly.runtime.planner import Planner
from evenly.runtime.strategy import ReadStrategy
from evenly.transport.slots import HOLD, Transport

__all__ = ["Engine"]


class Engine:
    """The private loader of one ``evenly.DataLoader``, and what its workers share."""

    def __init__(
        self,
        planner: Planner,
        *,
        batched: bool,
        collate_fn: Callable[[list[Any]], Any] | None,
        num_workers: int,
        transport: str,
        skipped: torch.Tensor,
        loader_args: dict[str, Any],
    ) -> None:
        self.planner = planner
        self.num_workers = num_workers
        self.transport = transport
        self.channel = PassChannel()
        self.feed = Feed(
            planner,
            self.channel,
            collate=(collate_fn or default_collate) if batched else None,
            per_sample=None if batched else (collate_fn or default_convert),
            skipped=skipped,
        )
        args = {k: v for k, v in loader_args.items() if k not in ("shuffle", "sampler")}
        self.persistent_workers = bool(args.get("persistent_workers", False))
        self.prefetch_factor = args.get("prefetch_factor") or 2
        self.loader = torch.utils.data.DataLoader(
            self.feed,
            batch_size=None,
            num_workers=num_workers,
            collate_fn=pass_through,
            **args,
        )
        self.timeout = float(args.get("timeout", 0) or 0)
        self.pin_memory = bool(args.get("pin_memory", False)) and torch.cuda.is_available()
        #: (what they were copied from, the reader threads' source copies)
        self._thread_views: tuple[tuple[int, int, int, int], list[SourceView]] | None = None
        self._iterator: weakref.ref[PassIterator] | None = None
        #: (len, fingerprint, generation) of the dataset when the workers started
        self._workers_view: tuple[int, int, int] | None = None

    def iterating(self) -> PassIterator | None:
        """The iterator of the pass last started, if the loop still holds it."""
        return self._iterator() if self._iterator is not None else None

    def follow(self, iterator: PassIterator) -> None:
        """Track ``iterator`` (it adopted the pass just started) as the one in use."""
        self._iterator = weakref.ref(iterator)

    def _running(self) -> Any:
        return torch_compat.running_iterator(self.loader)

    def _restart_stale_workers(self, view: tuple[int, int, int]) -> None:
        """Persistent workers hold the dataset as it was when they started: shut them
        down when its length, source fingerprint or generation changed since."""
        running = self._running()
        if running is not None and self._workers_view not in (None, view):
            settle(running, shut_down=False)
            torch_compat.shut_down_workers(running)
            torch_compat.drop_iterator(self.loader)

    def _new_transport(self) -> None:
        """Fresh slots for workers about to start (the old ones' are dropped)."""
        if self.feed.transport is not None:
            self.feed.transport.close()
            self.feed.transport = None
        if self.transport != "torch":
            hold = HOLD if self.transport == "slots" else 0  # "copy": copied out at once
            self.feed.transport = Transport(self.num_workers, self.prefetch_factor + 1, hold)

    def _thread_reads(
        self, spec: PassSpec, reads: ReadStrategy
    ) -> list[Callable[[], Iterator[Any]]]:
        """Each reader thread's share of the pass, read from its own source copy (kept
        while the dataset's source is the same object, its length and generation too);
        as many threads as the pass's reader strategy takes (a packed pass: one)."""
        planner, feed = self.planner, self.feed
        workers = reads.readers(self.num_workers)
        key = (id(planner.view), *planner.main_view())
        if self._thread_views is None or self._thread_views[0] != key:
            views = [SourceView.of(thread_copy(planner.view.source)) for _ in range(workers)]
            self._thread_views = (key, views)
        views = self._thread_views[1]
        pin = self.pin_memory

        def read(w: int) -> Iterator[Any]:
            clock = StageClock()  # each item with its stage times, as the feed's
            items = planner.read(
                spec,
                w,
                workers,
                collate=feed.collate,
                columnar=reads.columnar,
                skipped=feed.skipped,
                view=views[w],
                clock=clock,
                checked=True,  # the loader's main process checked at the pass start
            )
            if feed.per_sample is not None:
                items = map(feed.per_sample, items)
            if pin:
                items = map(torch_compat.pin_memory, items)
            return ((item, clock.take()) for item in items)

        return [partial(read, w) for w in range(workers)]

    def start(
        self,
        spec: PassSpec,
        plan: EpochPlan | StreamPlan,
        current: Pass,
        *,
        reads: ReadStrategy,
        on_end: Callable[[EpochPlan], None] | None,
        threads: bool = False,
    ) -> PassIterator:
        """Publish the pass to the workers and start iterating the private loader (or,
        with ``threads``, start ``num_workers`` reader threads in this process); ``reads``:
        the pass's reader strategy."""
        previous = self._iterator() if self._iterator is not None else None
        if previous is not None:  # the previous pass, finished or abandoned
            if isinstance(previous.inner, ThreadPass):
                previous.inner.close()
            else:
                settle(previous.inner, shut_down=True)
        self.feed.columnar = reads.columnar
        if threads:
            # batches a reader may hold beyond its queue: those of one read of several
            # batches (a columnar group, a packed read), so it reads the next meanwhile
            ahead = reads.ahead(spec.batch_size)
            readers = self._thread_reads(spec, reads)
            inner = ThreadPass(readers, self.prefetch_factor, self.timeout, ahead)
            iterator = PassIterator(inner, current, plan, on_end)
            self._iterator = weakref.ref(iterator)
            return iterator
        view = (spec.num_samples, self.planner.source_fingerprint(), spec.generation)
        self._restart_stale_workers(view)
        if self._running() is None:
            self._workers_view = view
        if self.num_workers > 0 and (self._running() is None or not self.persistent_workers):
            self._new_transport()
        self.channel.publish(spec)
        iterator = PassIterator(iter(self.loader), current, plan, on_end)
        self._iterator = weakref.ref(iterator)  # a weak one: do not keep workers alive
        return iterator
