"""The thread read path of ``evenly.DataLoader(worker_type="thread")``: ``num_workers``
reader threads in the main process, each reading the share of the pass that worker
``w`` of ``num_workers`` processes would read, from its own copy of the source, and the
loop taking their batches in the order torch's DataLoader takes its workers' (round
robin, a finished reader dropped from the turn).  So the batches and their order are
those of worker processes, and a checkpoint counts them the same way.

Nothing here relies on the GIL: each reader owns its source copy, its generator and its
bounded queue (``queue.Queue`` and ``threading.Event`` lock for themselves); the loop
only reads the queues.  Reads that release the GIL (numpy and Arrow gathers, ``pread``,
decompression) run in parallel; per-sample Python does not, which is why
``worker_type="auto"`` takes threads only for columnar reads.  Per-sample seeding of the
global generators (per process) is refused (see :func:`thread_safety_problem`).

>>> import evenly
>>> ds = evenly.Dataset(list(range(10)), shuffle=True, seed=1)
>>> threads = evenly.DataLoader(ds, batch_size=4, num_workers=2, worker_type="thread")
>>> procs = evenly.DataLoader(ds, batch_size=4, num_workers=2, worker_type="process")
>>> [b.tolist() for b in threads] == [b.tolist() for b in procs]
True
"""

from __future__ import annotations

import atexit
import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["ThreadPass", "thread_copy", "thread_safety_problem"]

_ITEMS, _END, _ERROR = 0, 1, 2
_POLL = 0.1  # seconds between looks at the stop flag while a queue is full or empty


def thread_copy(source: Any) -> Any:
    """The source a reader thread reads: its ``copy_for_thread()`` where it has one (a
    source with per-reader state: open files, caches, a memory-mapped window), else the
    source itself, shared (its ``__getitem__`` is then called from several threads)."""
    make = getattr(source, "copy_for_thread", None)
    return make() if callable(make) else source


def thread_safety_problem(
    transform: Any, seed_generators: tuple[str, ...], worker_init_fn: Any
) -> str | None:
    """Why this pass may not be read by threads (``None``: it may)."""
    if transform is not None and seed_generators:
        return (
            f"the transform runs with random, numpy or torch's global generator seeded per "
            f"sample (seed_generators={seed_generators!r}), and those are per process, so "
            f"threads would draw from each other's streams; pass seed_generators=() and "
            f"seed your own generator from evenly.sample_seed(), or worker_type='process'"
        )
    if worker_init_fn is not None:
        return "worker_init_fn runs in worker processes; use worker_type='process'"
    return None


def _reader(
    read: Callable[[], Iterator[Any]],
    out: queue.Queue[tuple[int, Any]],
    stop: threading.Event,
    ahead: int,
) -> None:
    """One reader thread: its batches into ``out`` as lists (whatever it has read while
    the loop was busy), then the end (or its error).  It blocks only once it holds
    ``ahead`` batches the loop has no room for: a source that reads several batches in
    one call (a columnar group) reads the next group while the loop takes this one's."""

    def put(message: tuple[int, Any], block: bool) -> bool:
        while not stop.is_set():
            try:
                out.put(message, block=block, timeout=_POLL if block else None)
                return True
            except queue.Full:
                if not block:
                    return False
        return False

    pending: list[Any] = []
    try:
        for item in read():
            pending.append(item)
            if put((_ITEMS, pending), block=len(pending) >= ahead):
                pending = []
            elif stop.is_set():
                return
        if pending and not put((_ITEMS, pending), block=True):
            return
        put((_END, None), block=True)
    except BaseException as exc:  # handed to the loop, raised there (after its batches)
        if not pending or put((_ITEMS, pending), block=True):
            put((_ERROR, exc), block=True)


class ThreadPass(Iterator[Any]):
    """One pass read by reader threads: ``reads[w]()`` is worker ``w``'s generator.

    ``prefetch``: hand-offs each reader may have waiting; ``ahead``: batches a reader
    holds besides them before it waits for the loop (so a reader is at most
    ``prefetch + ahead`` batches ahead); ``timeout``: seconds the loop waits for a batch
    before raising (0: forever, as torch's ``timeout``).
    """

    def __init__(
        self,
        reads: list[Callable[[], Iterator[Any]]],
        prefetch: int,
        timeout: float = 0.0,
        ahead: int = 1,
    ) -> None:
        self._stop = threading.Event()
        self._queues: list[queue.Queue[tuple[int, Any]]] = [
            queue.Queue(maxsize=max(1, prefetch)) for _ in reads
        ]
        self._ready: list[deque[Any]] = [deque() for _ in reads]  # taken, not yet handed out
        self._threads = [
            threading.Thread(
                target=_reader,
                args=(read, q, self._stop, max(1, ahead)),
                name=f"evenly-reader-{w}",
                daemon=True,  # a reader stuck in a read never keeps the interpreter alive
            )
            for w, (read, q) in enumerate(zip(reads, self._queues, strict=True))
        ]
        self._active = [True] * len(reads)
        self._turn = 0
        self._timeout = float(timeout)
        # an abandoned pass (dropped without close) stops its readers too
        self._finalizer = weakref.finalize(self, self._stop.set)
        _LIVE.add(self)
        for thread in self._threads:
            thread.start()

    def __iter__(self) -> ThreadPass:
        return self

    def __next__(self) -> Any:
        while any(self._active):
            w = self._turn
            self._turn = (self._turn + 1) % len(self._active)
            if not self._active[w]:
                continue
            ready = self._ready[w]
            while not ready:
                kind, value = self._get(w)
                if kind != _ITEMS:
                    break
                ready.extend(value)
            if ready:
                return ready.popleft()
            self._active[w] = False
            if kind == _ERROR:
                self.close()
                raise value
        self.close()
        raise StopIteration

    def _get(self, w: int) -> tuple[int, Any]:
        start = time.monotonic()
        while True:
            try:
                return self._queues[w].get(timeout=_POLL)
            except queue.Empty:
                pass
            if not self._threads[w].is_alive() and self._queues[w].empty():
                raise RuntimeError(f"evenly: reader thread {w} stopped without a result")
            if self._timeout and time.monotonic() - start > self._timeout:
                self.close()
                raise RuntimeError(
                    f"evenly: DataLoader timed out after {self._timeout:g} seconds waiting "
                    f"for reader thread {w}"
                )

    def settle(self) -> None:
        """Nothing to wait for: the readers were stopped when the last one ended."""

    def name_dead_workers(self, exc: BaseException) -> None:
        """Nothing to name: a reader's error is raised as it is."""

    def close(self, wait: float = 10.0) -> None:
        """Stop the readers (each finishes the read it is in) and wait for them (up to
        ``wait`` seconds each)."""
        self._stop.set()
        for ready in self._ready:
            ready.clear()
        for q in self._queues:  # a reader waiting for room sees the stop at once
            while True:
                try:
                    q.get_nowait()
                except queue.Empty:
                    break
        current = threading.current_thread()
        for thread in self._threads:
            if thread is not current:
                thread.join(timeout=wait)


#: the passes whose readers may still run: stopped before the interpreter exits
_LIVE: weakref.WeakSet[ThreadPass] = weakref.WeakSet()


@atexit.register
def _stop_readers() -> None:
    """Stop every reader thread before the interpreter finalizes: a daemon thread still
    inside a C++ call (torch's gather) when it does is killed there, which aborts the
    process ("terminate called without an active exception")."""
    for running in list(_LIVE):
        running.close(wait=2.0)
