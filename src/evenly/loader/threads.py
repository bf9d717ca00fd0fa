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

import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["ThreadPass", "thread_copy", "thread_safety_problem"]

_ITEM, _END, _ERROR = 0, 1, 2
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
) -> None:
    """One reader thread: its batches into ``out``, then the end (or its error)."""

    def put(message: tuple[int, Any]) -> bool:
        while not stop.is_set():
            try:
                out.put(message, timeout=_POLL)
                return True
            except queue.Full:
                continue
        return False

    try:
        for item in read():
            if not put((_ITEM, item)):
                return
        put((_END, None))
    except BaseException as exc:  # handed to the loop, raised there
        put((_ERROR, exc))


class ThreadPass(Iterator[Any]):
    """One pass read by reader threads: ``reads[w]()`` is worker ``w``'s generator.

    ``prefetch``: batches each reader may read ahead; ``timeout``: seconds the loop
    waits for a batch before raising (0: forever, as torch's ``timeout``).
    """

    def __init__(
        self, reads: list[Callable[[], Iterator[Any]]], prefetch: int, timeout: float = 0.0
    ) -> None:
        self._stop = threading.Event()
        self._queues: list[queue.Queue[tuple[int, Any]]] = [
            queue.Queue(maxsize=max(1, prefetch)) for _ in reads
        ]
        self._threads = [
            threading.Thread(
                target=_reader,
                args=(read, q, self._stop),
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
            kind, value = self._get(w)
            if kind == _ITEM:
                return value
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

    def close(self) -> None:
        """Stop the readers (each finishes the read it is in) and wait for them."""
        self._stop.set()
        for q in self._queues:  # a reader waiting for room sees the stop at once
            while True:
                try:
                    q.get_nowait()
                except queue.Empty:
                    break
        current = threading.current_thread()
        for thread in self._threads:
            if thread is not current:
                thread.join(timeout=10)
