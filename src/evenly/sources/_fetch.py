"""Plan-driven fetching of remote shards for the shard cache: a per-process scheduler
whose download threads together with every other process's on the node keep at most
``max_in_flight`` requests in flight.

- **A node-wide bound**: each process runs ``max(1, max_in_flight // processes)``
  download threads, processes on the node being ``$LOCAL_WORLD_SIZE`` (torchrun; else 1)
  times the DataLoader workers of the process's loader (1 without workers).  A thread
  makes one request at a time, so the node never has more than ``max_in_flight``
  requests in flight (the floor, unlike a ceiling, never overshoots; with more
  processes than ``max_in_flight`` each still gets one).  No process talks to another:
  nothing to hang on or to clean up after a killed worker.
- **Order of need**: shards a reader waits for come first, then the look-ahead the plan
  hints (:meth:`Fetcher.hint`, in order of first use); a shard of twice
  :data:`PART_BYTES` or more is split into equal parts (:func:`part_bytes`: 8 to 16
  MiB, one range request each) that the threads download side by side, so the shard
  needed next gets every thread before the one after it.  A shard a
  reader waits for (the pass's first batch, or a look-ahead that fell behind) is split
  over all the threads (parts of at least :data:`MIN_PART_BYTES`): the shards a batch
  waits for arrive one after the other, each at the whole link, so the reader decodes
  the first while the next ones download.
- **Behind the first read**: look-ahead hinted under a :class:`Hold` (the reader's
  hints for a pass, given just before its first batch is read) waits until that batch
  has every shard it asked for (and every other download of the process not held has
  ended), or the hold is released (after the batch is read), so that the first batch
  has the link to itself and the look-ahead starts as soon as its downloads end, not
  after its decode.  A held shard hinted again without a hold is held no more.
- **Cooperation**: a thread that finds a shard's lock held by another process (a
  worker or rank downloading it) does not wait: it goes on to the next shard; only a
  reader that needs that shard now waits for the other process's download.  A shard
  read while this process's download of it is still queued (held, or beyond the
  cache's room) leaves the queue: started after another process evicted it, that
  download would fetch it a second time.
- **Bounded by the cache**: the look-ahead starts a download only while the node's
  pinned shards and that shard fit in ``max_bytes``: this process's (downloads running,
  its own or another process's, downloaded but not read yet, and the shards it read last,
  up to half the cache) and those only other processes pin.  Each process lists its
  pinned shards and their bytes in a pin file (``<cache_dir>/shard-pins/<pid>-<host>``),
  so the workers and ranks sharing a cache together never queue more than it holds;
  eviction, by any process, skips the shards a live process pinned, so a shard a worker
  still needs is not evicted by another one before it is read (a shard of its
  look-ahead that another process brought in is pinned too, until read).  A shard whose rows are
  kept decoded beside it (remote Parquet, :meth:`Fetcher.decoded`) counts with that
  copy, and for the copy only once its download is dropped.

>>> node_processes({"LOCAL_WORLD_SIZE": "2"}, workers=4), threads_for(16, 8), threads_for(4, 8)
(8, 2, 1)
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Collection, Iterable, Iterator, Mapping
from typing import Protocol

from filelock import FileLock, Timeout

from ._cachedir import LOCK_POLL, STALE_PART_SECONDS, host_tag, part_path

__all__ = [
    "DEFAULT_MAX_IN_FLIGHT",
    "ENV_MAX_IN_FLIGHT",
    "MIN_PART_BYTES",
    "PART_BYTES",
    "Fetcher",
    "Hold",
    "max_in_flight_setting",
    "node_processes",
    "part_bytes",
    "pinned_elsewhere",
    "threads_for",
]

#: Requests in flight per node by default (``$EVENLY_MAX_IN_FLIGHT`` overrides it).
DEFAULT_MAX_IN_FLIGHT = 16
#: the environment variable that overrides the default bound
ENV_MAX_IN_FLIGHT = "EVENLY_MAX_IN_FLIGHT"
#: the least bytes per range request of a large object (one under twice this: one request)
PART_BYTES = 8 << 20
#: the smallest part of a shard a reader waits for, split over the threads
MIN_PART_BYTES = 2 << 20
#: jobs hinted this many hints ago and never started are dropped (a pass left early)
_STALE_HINTS = 3
#: the shortest time between two recency refreshes of the pinned shards
_TOUCH_EVERY = 1.0
#: how often threads look again at look-ahead held behind the reads
_HELD_POLL = 0.02
#: the longest the bytes other processes pin are reused before their pin files are read
_OTHERS_EVERY = 0.05
#: shards whose decoded copy's bytes a process remembers (see Fetcher.decoded)
_MAX_DECODED = 4096


_holding = threading.local()  # .hold: the Hold that hints of this thread go under


class Hold:
    """Look-ahead hinted inside :meth:`holding` (in this thread) waits behind the
    reads: a fetcher starts it once its process's reader asked for a shard after the
    hint and has every shard it asked for (no download not held is left), or once
    :meth:`release` is called, whichever comes first.  What is held is only delayed,
    never dropped.

    >>> hold = Hold()
    >>> with hold.holding():
    ...     Hold.current() is hold
    True
    >>> Hold.current() is None, hold.released
    (True, False)
    """

    __slots__ = ("_fetchers", "released")

    def __init__(self) -> None:
        self.released = False
        self._fetchers: list[Fetcher] = []

    @contextlib.contextmanager
    def holding(self) -> Iterator[None]:
        """Hints of this thread inside the block go under this hold."""
        before = getattr(_holding, "hold", None)
        _holding.hold = self
        try:
            yield
        finally:
            _holding.hold = before

    @staticmethod
    def current() -> Hold | None:
        """The hold this thread's hints go under now, if any."""
        return getattr(_holding, "hold", None)

    def add(self, fetcher: Fetcher) -> None:
        """``fetcher`` holds jobs under this hold (woken when it is released)."""
        if fetcher not in self._fetchers:
            self._fetchers.append(fetcher)

    def release(self) -> None:
        """Let every held job start (the fetchers that hold some are woken)."""
        if self.released:
            return
        self.released = True
        fetchers, self._fetchers = self._fetchers, []
        for fetcher in fetchers:
            fetcher.wake()


def max_in_flight_setting(value: int | None) -> int:
    """The node-wide bound on requests in flight: ``value``, else
    ``$EVENLY_MAX_IN_FLIGHT``, else :data:`DEFAULT_MAX_IN_FLIGHT`; at least 1."""
    if value is None:
        raw = os.environ.get(ENV_MAX_IN_FLIGHT)
        try:
            value = DEFAULT_MAX_IN_FLIGHT if raw is None else int(raw)
        except ValueError:
            raise ValueError(
                f"${ENV_MAX_IN_FLIGHT}={raw!r} is not an integer: set it to the number of "
                f"requests in flight per node (>= 1, default {DEFAULT_MAX_IN_FLIGHT})"
            ) from None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"max_in_flight must be an integer >= 1 (requests in flight per node, default "
            f"{DEFAULT_MAX_IN_FLIGHT}), got {value!r}"
        )
    return value


def node_processes(environ: Mapping[str, str], workers: int) -> int:
    """Processes reading on this node: ``LOCAL_WORLD_SIZE`` (torchrun's; 1 if unset)
    times ``max(1, workers)``."""
    try:
        local = int(environ.get("LOCAL_WORLD_SIZE", "1"))
    except ValueError:
        local = 1
    return max(1, local) * max(1, workers)


def threads_for(max_in_flight: int, processes: int) -> int:
    """Download threads of one process: its share of the node's bound, at least 1."""
    return max(1, max_in_flight // max(1, processes))


def part_bytes(size: int, threads: int = 1) -> int:
    """Bytes per range request of an object of ``size`` bytes: split into equal parts of
    :data:`PART_BYTES` to twice that (an object under twice it is one request: a part of
    a few bytes beside a whole one would cost a request, a round trip and the server's
    work for nothing); for one a reader waits for, split over its ``threads`` (> 1) in
    parts of :data:`MIN_PART_BYTES` to :data:`PART_BYTES`.

    >>> MiB = 1 << 20
    >>> part_bytes(8 * MiB + 9), part_bytes(17 * MiB) / MiB, part_bytes(8 * MiB + 8, 4)
    (8388617, 8.5, 2097154)
    """
    if threads > 1:
        return min(PART_BYTES, max(MIN_PART_BYTES, -(-size // threads)))
    return -(-size // max(1, size // PART_BYTES))


def _pins_dir(cache_dir: str) -> str:
    """Beside the shard cache dir (which holds shards, downloads and locks only)."""
    return os.path.join(os.path.dirname(cache_dir), "shard-pins")


def write_pins(cache_dir: str, names: Collection[str] | Mapping[str, int]) -> None:
    """Publish this process's pinned shard names (atomically replaced), each with its
    bytes where known (``names`` a mapping: a line ``<name>\t<bytes>`` each)."""
    folder = _pins_dir(cache_dir)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{os.getpid()}-{host_tag()}")
    tmp = f"{path}.tmp"
    sizes = names if isinstance(names, Mapping) else {}
    with open(tmp, "w") as f:
        f.write("\n".join(f"{n}\t{sizes[n]}" if n in sizes else n for n in sorted(names)))
    os.replace(tmp, path)


def pinned_elsewhere(cache_dir: str) -> set[str]:
    """Shard names pinned by the live processes that use ``cache_dir`` (pin files of
    dead processes of this host are removed; another host's count until stale)."""
    return set(pins(cache_dir))


def pins(cache_dir: str, but_mine: bool = False) -> dict[str, int | None]:
    """Shard names pinned by the live processes that use ``cache_dir``, with the bytes
    their pin file gives (None: not given); ``but_mine``: not this process's own."""
    folder = _pins_dir(cache_dir)
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return {}
    out: dict[str, int | None] = {}
    here = host_tag()
    mine = f"{os.getpid()}-{here}"
    for name in names:
        if name.endswith(".tmp") or (but_mine and name == mine):
            continue
        path = os.path.join(folder, name)
        pid, _, host = name.partition("-")
        try:
            if host == here and pid.isdigit():
                try:
                    os.kill(int(pid), 0)
                except ProcessLookupError:
                    os.unlink(path)
                    continue
                except PermissionError:
                    pass
            elif time.time() - os.stat(path).st_mtime > STALE_PART_SECONDS:
                continue
            with open(path) as f:
                for line in f.read().split("\n"):
                    shard, _, size = line.partition("\t")
                    if shard:
                        out[shard] = int(size) if size.isdigit() else None
        except FileNotFoundError:
            continue
    return out


def _workers_here() -> int:
    """The DataLoader workers of this process's loader (0 outside a worker)."""
    from torch.utils.data import get_worker_info

    info = get_worker_info()
    return 0 if info is None else int(info.num_workers)


class Ranged(Protocol):
    """An object opened for range reads, at the version the listing gave."""

    def read_into(self, start: int, end: int, fd: int) -> int: ...

    def close(self) -> None: ...


class Store(Protocol):
    """What the scheduler needs of the shard cache."""

    max_bytes: int
    cache_dir: str

    def path_for(self, url: str, fingerprint: str = "") -> str: ...

    def download_whole(self, url: str, target: str, size: int | None, fingerprint: str) -> None:
        """One checked download of ``url`` into ``target`` (the caller holds its lock)."""

    def open_ranged(self, url: str, fingerprint: str, size: int | None) -> tuple[Ranged, int]:
        """The object opened for range reads (version checked), and its size."""

    def write_part(self, url: str, ranged: Ranged, start: int, end: int, fd: int) -> None:
        """Bytes ``[start, end)`` of the object written to ``fd`` at ``start`` (retried,
        checked)."""

    def evict(self, keep: str | Collection[str] | None = None) -> list[str]: ...

    def count(self, **values: float) -> None: ...


class Job:
    """One shard to bring into the cache."""

    __slots__ = (
        "busy",
        "demand",
        "done",
        "error",
        "fd",
        "fingerprint",
        "held",
        "hint",
        "left",
        "lock",
        "parts",
        "ranged",
        "size",
        "state",
        "target",
        "tmp",
        "url",
    )

    def __init__(
        self, url: str, fingerprint: str, size: int | None, target: str, hint: int
    ) -> None:
        self.url, self.fingerprint, self.size, self.target = url, fingerprint, size, target
        #: queued, starting, running, ok (on disk), failed, elsewhere (another process has it)
        self.state = "queued"
        self.demand = False  #: a reader waits for it
        self.hint = hint  #: the hint that queued it
        #: held behind the reads: the hold and the reader's asks when it was hinted
        self.held: tuple[Hold, int] | None = None
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.lock: FileLock | None = None
        self.parts: deque[tuple[int, int]] = deque()
        self.left = 0  #: parts not written yet
        self.busy = 0  #: parts being fetched now
        self.fd = -1
        self.tmp = ""
        self.ranged: Ranged | None = None

    @property
    def nbytes(self) -> int:
        return self.size if self.size is not None else PART_BYTES


class Fetcher:
    """The download threads of one process and the queue they serve (see the module
    docstring).  Made lazily in each process by the shard cache; never pickled."""

    def __init__(self, store: Store, max_in_flight: int, threads: int | None = None) -> None:
        self.store = store
        self.threads = threads or threads_for(
            max_in_flight, node_processes(os.environ, _workers_here())
        )
        self._cond = threading.Condition()
        self._queue: list[Job] = []  # demanded first, then in order of first use
        self._jobs: dict[str, Job] = {}  # target -> job queued, running or not read yet
        self._recent: OrderedDict[str, int] = OrderedDict()  # shards read lately, last newest
        self._started: list[threading.Thread] = []
        self._hints = 0
        self._touched = 0.0
        self._flight_lock = threading.Lock()
        self._published: dict[str, int] | None = None
        #: the shards other processes pin and their bytes, as last read (see _pinned_by_others)
        self._others: dict[str, int] = {}
        self._others_at = -_OTHERS_EVERY
        self.in_flight = 0
        self.max_in_flight_seen = 0
        self._asks = 0  # the reader's requests for shards (a wait or a ``now`` hint)
        #: bytes of a shard's decoded copy written (or to be written) beside it in the
        #: cache (remote Parquet kept decoded, see :meth:`decoded`)
        self._decoded: dict[str, int] = {}
        self._held_back = False  # _next passed over held jobs

    # ---- what the cache calls ----------------------------------------------------------
    def hint(self, items: Iterable[tuple[str, str, int | None]], now: bool = False) -> None:
        """Queue the downloads of shards not cached yet: the plan's look-ahead, in order
        of first use (``now``: needed by the batch being read, ahead of the look-ahead)."""
        hold = None if now else Hold.current()
        if hold is not None and hold.released:
            hold = None
        with self._cond:
            number = self._hints + 1  # this hint's number, if it queues a look-ahead job
            self._asks += now
            front: list[Job] = []
            for url, fingerprint, size in items:
                target = self.store.path_for(url, fingerprint)
                job = self._jobs.get(target)
                if job is not None and job.state not in ("failed", "elsewhere"):
                    if hold is None:  # hinted for a read, not behind one: held no more
                        job.held = None
                    if now and job.state == "queued" and not job.demand:
                        self._queue.remove(job)
                        job.demand = True
                        front.append(job)
                    continue
                if os.path.exists(target):  # cached: never fetched again
                    if not now:  # but pinned until read (another process may evict it)
                        job = Job(url, fingerprint, size, target, number)
                        job.state = "ok"
                        job.done.set()
                        self._jobs[target] = job
                    continue
                if not now and job is None:
                    # only a hint that queues a new look-ahead job ages the queued ones
                    # (see _drop_stale): a tar batch hints the shards it reads, queued
                    # long ago or being downloaded by another worker ("elsewhere"), and
                    # three of them dropped the pass's look-ahead
                    self._hints = number
                job = Job(url, fingerprint, size, target, number)
                job.demand = now
                if hold is not None:
                    job.held = (hold, self._asks)
                self._jobs[target] = job
                (front if now else self._queue).append(job)
            if front:
                self._queue[:0] = front
            if hold is not None:
                hold.add(self)
            self._drop_stale()
            self._cond.notify_all()
        self._touch_pinned()
        self._publish()
        self._start_threads()

    def wait(self, url: str, fingerprint: str, size: int | None) -> str:
        """The local path of the shard, downloaded first if needed (ahead of the
        look-ahead); raises the download's error in this thread (a look-ahead download
        that failed is tried once more, for this reader)."""
        target = self.store.path_for(url, fingerprint)
        started: float | None = None
        try:
            while True:
                if os.path.exists(target):
                    with contextlib.suppress(FileNotFoundError):
                        os.utime(target)
                    self._read(target, size)
                    self._publish()
                    return target
                if started is None:
                    started = time.perf_counter()
                job, fresh = self._demand(url, fingerprint, size, target)
                self._start_threads()
                job.done.wait()
                if job.state == "elsewhere":  # another process downloads it: wait for it
                    with FileLock(target + ".lock").acquire(poll_interval=LOCK_POLL):
                        pass
                elif job.state == "failed" and fresh and job.error is not None:
                    raise job.error
        finally:
            if started is not None:
                self.store.count(fetch_seconds=time.perf_counter() - started)

    def pinned(self) -> dict[str, int]:
        """Targets this process must keep (bytes each, with their decoded copy: see
        :meth:`footprint`): downloads running or not read yet, and the shards it read
        last, up to half the cache (by their listed bytes)."""
        with self._cond:
            out = {
                t: self.footprint(t, j.nbytes) for t, j in self._jobs.items() if j.state in _AHEAD
            }
            half, total = self.store.max_bytes // 2, 0
            for target in reversed(self._recent):
                size = self._recent[target]
                if total and total + size > half:
                    break
                out.setdefault(target, self.footprint(target, size))
                total += size
            return out

    def decoded(self, target: str, nbytes: int) -> None:
        """``target``'s row groups are kept decoded beside it in the cache, ``nbytes`` in
        all (by its footer): from now on it counts for its download and that copy (the
        look-ahead leaves room for both, and the pin file says so to the other
        processes), until it is retired (then for its copy only)."""
        with self._cond:
            if self._decoded.get(target) == nbytes:
                return
            self._decoded[target] = nbytes
            while len(self._decoded) > _MAX_DECODED:  # forget the oldest (read long ago)
                del self._decoded[next(iter(self._decoded))]
        self._publish()

    def footprint(self, target: str, size: int) -> int:
        """Bytes ``target`` (``size`` bytes listed) takes in the cache: its download, plus
        its decoded copy when it is kept decoded (:meth:`decoded`), and only that copy
        once the download was dropped (retired: an empty file)."""
        extra = self._decoded.get(target)
        if not extra:
            return size
        try:
            if os.path.getsize(target) == 0:
                return extra  # retired: the decoded copy only
        except OSError:
            pass  # not there yet (downloading), or evicted: counted whole
        return size + extra

    def wake(self) -> None:
        """Let the download threads look at the queue again (a hold was released)."""
        with self._cond:
            self._cond.notify_all()

    # ---- the queue ---------------------------------------------------------------------
    def _demand(
        self, url: str, fingerprint: str, size: int | None, target: str
    ) -> tuple[Job, bool]:
        """The job a reader waits for, first in the queue; True if made for it."""
        with self._cond:
            job = self._jobs.get(target)
            fresh = job is None or job.state in ("failed", "elsewhere", "ok")
            if job is None or fresh:
                job = Job(url, fingerprint, size, target, self._hints)
                self._jobs[target] = job
                self._queue.insert(0, job)
            elif job.state == "queued":
                self._queue.remove(job)
                self._queue.insert(0, job)
            job.demand = True
            self._asks += 1  # with the demand marked: held jobs see both at once
            self._cond.notify_all()
            return job, fresh

    def _read(self, target: str, size: int | None) -> None:
        """``target`` was read: it leaves the look-ahead for the recently read.  A
        download of it still queued (another process brought it in first, while this
        one's was held or beyond the cache's room) is done: started later, after the
        shard was read and perhaps evicted, it would fetch it again for nothing."""
        with self._cond:
            job = self._jobs.get(target)
            if job is not None and job.state == "queued":
                self._queue.remove(job)
                job.state = "ok"
                job.done.set()
            if job is not None and job.state in ("ok", "failed", "elsewhere"):
                del self._jobs[target]
            self._recent.pop(target, None)
            self._recent[target] = size if size is not None else PART_BYTES
            while len(self._recent) > 1 and sum(self._recent.values()) > self.store.max_bytes:
                self._recent.popitem(last=False)
            self._cond.notify_all()  # room for the look-ahead, perhaps

    def read_elsewhere(self, target: str, size: int | None) -> None:
        """``target``'s rows were read without it (decoded by another process, see
        :meth:`ShardCache.seen`): it counts as read (:meth:`_read`: a download of it
        still queued is dropped), and the pin file says so (as after a wait)."""
        self._read(target, size)
        self._publish()

    def _drop_stale(self) -> None:
        """Forget look-ahead jobs hinted long ago and never read (a pass left early):
        not started ones are dropped, downloaded ones no longer pinned."""
        old = self._hints - _STALE_HINTS
        for job in [j for j in self._jobs.values() if not j.demand and j.hint <= old]:
            if job.state == "queued":
                self._queue.remove(job)
                job.state = "failed"
                job.done.set()
            elif job.state not in ("ok", "elsewhere"):
                continue
            del self._jobs[job.target]

    def _next(self) -> tuple[Job, tuple[int, int] | None] | None:
        """The next unit of work, or None: a part of a running download, or a shard to
        start (a look-ahead one only while it fits in the cache beside what is pinned)."""
        left: int | None = None
        waiting: bool | None = None
        self._held_back = False
        for job in self._queue:
            if job.state == "running" and job.parts:
                job.busy += 1
                return job, job.parts.popleft()
            if job.state == "starting" and job.demand and (job.size or 0) > self.part_bytes(job):
                # a shard a reader waits for, about to be split: its parts before the next
                # shard (which would share the link with it), so that the shards a batch
                # waits for arrive one after the other; woken when it has started
                return None
            if job.state != "queued":
                continue
            if not job.demand:
                if job.held is not None:
                    if waiting is None:
                        waiting = self._reads_wait()
                    hold, asks = job.held
                    if not hold.released and (waiting or self._asks <= asks):
                        self._held_back = True  # looked at again soon (see _run)
                        continue  # behind the reads: later
                    job.held = None
                if os.path.exists(job.target):
                    # brought in by another process meanwhile: nothing to make room for,
                    # and pinned (state ok) until read, so no eviction takes it before
                    job.state = "starting"
                    return job, None
                if left is None:
                    used = (
                        sum(
                            self.footprint(j.target, j.nbytes)
                            for j in self._jobs.values()
                            if j.state in _AHEAD
                        )
                        + self._recent_pinned()
                        + self._pinned_by_others()
                    )
                    left = self.store.max_bytes - used
                if job.nbytes > left:
                    continue  # beyond what the cache holds: later, when reads free room
                left -= job.nbytes
            job.state = "starting"
            return job, None
        return None

    def _reads_wait(self) -> bool:
        """Whether a shard not held behind the reads (one a reader asked for, or one
        hinted for a read) is not in the cache yet (downloading here or in another
        process)."""
        return any(
            (j.demand or j.held is None)
            and (
                j.state in ("queued", "starting", "running")
                or (j.state == "elsewhere" and not os.path.exists(j.target))
            )
            for j in self._jobs.values()
        )

    def _pinned_by_others(self) -> int:
        """Bytes of the shards only other processes pin (their pin files: what they read
        now, download, or downloaded ahead), so that together the workers and ranks
        sharing a cache never queue more than it holds.  The pin files are read again
        at most every :data:`_OTHERS_EVERY` seconds; what this process pins is taken as
        it is now (a shard it no longer pins, still pinned by another, counts again)."""
        now = time.monotonic()
        if now - self._others_at >= _OTHERS_EVERY:
            others = {}
            for name, size in pins(self.store.cache_dir, but_mine=True).items():
                if size is None:
                    with contextlib.suppress(OSError):
                        size = os.stat(os.path.join(self.store.cache_dir, name)).st_size
                others[name] = size or 0
            self._others, self._others_at = others, now
        mine = {os.path.basename(t): n for t, n in self.pinned().items()}
        # a shard this process counts too: only what another process counts beyond it
        # (the decoded copy of a shard that process decoded first)
        return sum(
            max(0, n - mine[name]) if name in mine else n for name, n in self._others.items()
        )

    def _recent_pinned(self) -> int:
        half, total = self.store.max_bytes // 2, 0
        for target in reversed(self._recent):
            size = self._recent[target]
            if total and total + size > half:
                break
            if target not in self._jobs:
                total += self.footprint(target, size)
        return total

    def _start_threads(self) -> None:
        if len(self._started) >= self.threads:
            return
        with self._cond:
            while len(self._started) < self.threads:
                thread = threading.Thread(target=self._run, name="evenly-fetch", daemon=True)
                thread.start()
                self._started.append(thread)

    def _run(self) -> None:
        while True:
            with self._cond:
                unit = self._next()
                while unit is None:
                    # held jobs wait for shards that may land in another process (no
                    # notice here): look again every _HELD_POLL seconds
                    self._cond.wait(_HELD_POLL if self._held_back else None)
                    unit = self._next()
            job, part = unit
            try:
                if part is None:
                    self._begin(job)
                else:
                    self._part(job, part)
            except BaseException as exc:  # raised again by the reader that waits
                self._fail(job, exc)
            with self._cond:
                self._cond.notify_all()

    # ---- one download --------------------------------------------------------------------
    def _begin(self, job: Job) -> None:
        """Take the shard's lock (or leave it to the process that holds it), then
        download it whole, or open it and queue its parts."""
        if os.path.exists(job.target):
            return self._finished(job, "ok")
        os.makedirs(os.path.dirname(job.target), exist_ok=True)
        lock = FileLock(job.target + ".lock", thread_local=False)
        try:
            lock.acquire(timeout=0)
        except Timeout:
            return self._finished(job, "elsewhere")
        if os.path.exists(job.target):  # another process fetched it just before
            lock.release()
            return self._finished(job, "ok")
        job.lock = lock
        # named in the pin file before the shard appears: another process's eviction
        # would otherwise take it between its rename and this process's next publish
        self._publish()
        part = self.part_bytes(job)
        if job.size is None or job.size <= part:
            with self.request():
                self.store.download_whole(job.url, job.target, job.size, job.fingerprint)
            self._release(job)
            self._evict()  # before a reader goes on: the job still pins its shard
            self._finished(job, "ok")
            return None
        with self.request():
            ranged, size = self.store.open_ranged(job.url, job.fingerprint, job.size)
        job.ranged, job.size = ranged, size
        job.tmp = part_path(job.target)
        job.fd = os.open(job.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        os.ftruncate(job.fd, size)
        with self._cond:
            job.parts = deque((s, min(s + part, size)) for s in range(0, size, part))
            job.left = len(job.parts)
            job.state = "running"
        return None

    def part_bytes(self, job: Job) -> int:
        """Bytes per range request of ``job`` (its size: one request): see
        :func:`part_bytes`."""
        if job.size is None:
            return PART_BYTES
        return part_bytes(job.size, self.threads if job.demand else 1)

    def _part(self, job: Job, part: tuple[int, int]) -> None:
        start, end = part
        written = False
        try:
            if job.state == "running" and job.ranged is not None:
                with self.request():  # streamed to the file: no buffer of the part
                    self.store.write_part(job.url, job.ranged, start, end, job.fd)
                written = True
        finally:
            with self._cond:
                job.busy -= 1
                job.left -= written
                last = job.busy == 0 and (
                    job.state == "failed" or (job.state == "running" and job.left == 0)
                )
        if not last:
            return
        if job.state == "failed":
            self._cleanup(job)
            return
        self._close(job)
        got = os.path.getsize(job.tmp)
        if got != job.size:
            raise ValueError(
                f"the download of {job.url} has {got} bytes but the object has {job.size}"
            )
        self.store.count(downloads=1)  # before the shard appears: a reader of it sees it
        os.replace(job.tmp, job.target)
        self._release(job)
        self._evict()  # before a reader goes on: the job still pins its shard
        self._finished(job, "ok")

    def _evict(self) -> None:
        """Publish this process's pins, then evict (the cache keeps every live
        process's pins)."""
        self._publish()
        self.store.evict(keep=self.pinned())

    def _publish(self) -> None:
        """Write this process's pin file if its pinned shards changed."""
        names = {os.path.basename(t): size for t, size in self.pinned().items()}
        if names == self._published:
            return
        with contextlib.suppress(OSError):  # a read-only cache dir: pins are a hint
            write_pins(self.store.cache_dir, names)
            self._published = names

    def _fail(self, job: Job, exc: BaseException) -> None:
        with self._cond:
            if job.state in ("ok", "failed"):
                return
            job.error = exc
            job.state = "failed"
            job.parts.clear()
            idle = job.busy == 0
        if idle:
            self._cleanup(job)
        self._finished(job, "failed")

    def _cleanup(self, job: Job) -> None:
        """A failed download: no part file left, the lock free."""
        self._close(job)
        if job.tmp:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(job.tmp)
        self._release(job)

    def _close(self, job: Job) -> None:
        if job.fd >= 0:
            os.close(job.fd)
            job.fd = -1
        if job.ranged is not None:
            with contextlib.suppress(Exception):
                job.ranged.close()
            job.ranged = None

    def _release(self, job: Job) -> None:
        if job.lock is not None:
            with contextlib.suppress(Exception):
                job.lock.release()
            job.lock = None

    def _finished(self, job: Job, state: str) -> None:
        with self._cond:
            job.state = state
            if job in self._queue:
                self._queue.remove(job)
            if state == "failed" and not job.demand:
                self._jobs.pop(job.target, None)  # a look-ahead that failed: the reader retries
            self._cond.notify_all()
        job.done.set()

    @contextlib.contextmanager
    def request(self) -> Iterator[None]:
        """Count a request in flight (``max_in_flight_seen``)."""
        with self._flight_lock:
            self.in_flight += 1
            self.max_in_flight_seen = max(self.max_in_flight_seen, self.in_flight)
        try:
            yield
        finally:
            with self._flight_lock:
                self.in_flight -= 1

    def _touch_pinned(self) -> None:
        """Keep the shards this process uses most recently used, so another process's
        eviction takes them last (at most once a second)."""
        now = time.monotonic()
        if now - self._touched < _TOUCH_EVERY:
            return
        self._touched = now
        for target in self.pinned():
            with contextlib.suppress(FileNotFoundError):
                os.utime(target)


#: job states whose shard this process pins and counts in its look-ahead: downloads
#: running (its own, or another process's), or done and not read yet
_AHEAD = frozenset({"starting", "running", "ok", "elsewhere"})
