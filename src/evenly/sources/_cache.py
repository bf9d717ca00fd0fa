"""A bounded local cache of remote shards, shared by every process on the machine.

- A shard is downloaded with fsspec (or obstore, for ``s3://`` where it is chosen:
  :mod:`evenly.sources._obstore`) to a temp file in the cache dir (``<name>.part-*``),
  checked against the size the listing gave, then renamed into place: a partial or
  wrong-sized download is never visible under the shard's name.
- A download reads the version the listing gave: the object's ``info`` (its size and
  ETag) is compared with the listed fingerprint before a byte is copied, and s3fs sends
  that ETag with every range read (``If-Match``; obstore with its one GET, or each part),
  so an object replaced before or during the download raises naming the URL; nothing of
  it is cached.
- A lock file per shard (``filelock``: no ``fcntl`` at import, so it works on every
  platform) makes one download per machine: a reader that needs a shard another worker
  (or rank) is downloading waits for it; a look-ahead download goes on to the next shard
  instead.  The downloader holds it for the whole download, so a ``.part-*`` file whose
  lock is free was left by a killed process: it is counted in the cache usage, and
  removed by the next eviction.
- Downloads run in each process's download threads (:mod:`evenly.sources._fetch`): at
  most ``max_in_flight`` requests in flight per node, shards in order of need (a reader
  waiting first, then the plan's look-ahead as far as the cache holds it), an object
  of twice :data:`~evenly.sources._fetch.PART_BYTES` or more in parallel range requests
  (:func:`~evenly.sources._fetch.part_bytes`) written at their offsets into the
  ``.part-`` file, renamed once every part arrived and the size is the listed one.
- Transient errors (connection refused or reset, timeouts, HTTP 5xx, 429 and S3
  throttling) are retried with exponential backoff (``retries`` more tries, ``backoff``
  seconds doubling, with jitter); the last error is raised naming the URL.
- After each download, files are evicted least-recently-used first (by mtime, which a
  hit refreshes) until the cache holds at most ``max_bytes``; the shards the process
  pinned (being downloaded, downloaded and not read yet, read last) are never evicted
  by it.  A reader that still has an evicted file open keeps reading it (POSIX).
- Remote Parquet keeps its row groups decoded beside their shard
  (``<shard>@rg<g>-<hash>.arrow``, :mod:`evenly.sources._rowcache`), in the same bound;
  once every row group of a shard is decoded, the shard is retired (:meth:`retire`: its
  file replaced by an empty one, a marker that its rows are here decoded, so the
  look-ahead does not fetch it again): one copy per shard.  Eviction keeps the entries
  of a shard a live process pins with it, and drops the marker of a shard with an entry
  evicted (its shard is then fetched again when needed).  The look-ahead counts a
  shard with its entries once it is known to be kept decoded (:meth:`decoding`).
- ``prefetch(items)`` queues the look-ahead; :meth:`ShardCache.stats` counts what was
  fetched (``bytes_fetched``, ``fetch_requests``, ``fetch_seconds``, ``fetch_retries``,
  ``max_in_flight_seen``).
- Credentials refused (HTTP 403: expired, or no right to read) are not retried: the
  error names the URL and the likely cause.

Cache file names are a hash of (URL, fingerprint) plus a sanitised base name, so they
never escape the cache dir and a changed remote file is fetched again.

>>> cache = ShardCache("/tmp/evenly-cache-doctest", max_bytes=1 << 30)
>>> cache.max_bytes, cache.retries, cache.max_in_flight
(1073741824, 4, 16)
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import threading
from collections.abc import Callable, Collection, Iterable
from typing import Any, TypeVar

from filelock import FileLock, Timeout

from ._cachedir import ENTRY_MARK, part_path
from ._fetch import Fetcher, max_in_flight_setting, pinned_elsewhere
from ._lrudir import LruDir
from ._manifest import filesystem, object_fingerprint, same_version
from ._obstore import ObjectStore, VersionChanged, chosen, listed_etag, store_for
from ._remote_rules import BACKOFF, RETRIES, is_transient, retrying

__all__ = ["DEFAULT_CACHE_BYTES", "FETCH_COUNTERS", "ShardCache", "is_transient"]

logger = logging.getLogger("evenly")

#: Default cache size limit: 8 GiB (``$EVENLY_CACHE_BYTES`` overrides it).
DEFAULT_CACHE_BYTES = 8 << 30
_SAFE = re.compile(r"[^A-Za-z0-9._-]+")
#: the longest :meth:`ShardCache.retire` waits for its shard's lock (held only briefly
#: once the shard is whole: an eviction's look, a restore); then the shard stays, correct
_RETIRE_WAIT = 60.0
#: bytes per read of a checked download (a range request each)
_CHUNK = 16 << 20
T = TypeVar("T")
#: the counters :meth:`ShardCache.stats` reports (cumulative, this process)
FETCH_COUNTERS = (
    "bytes_fetched",
    "fetch_requests",
    "fetch_seconds",
    "fetch_retries",
    "max_in_flight_seen",
)


class ShardCache:
    """Local copies of remote shards under ``cache_dir``, at most ``max_bytes`` in all.

    Picklable: the download threads are made lazily in each process.

    Args:
        cache_dir: where the copies live (created if needed).
        max_bytes: the size limit; the cache may exceed it only by the shards in use
            and downloads in progress.
        storage_options: passed to fsspec (endpoint, credentials...).
        max_in_flight: requests in flight per node, shared by every process on it
            (default ``$EVENLY_MAX_IN_FLIGHT``, else 16).
        retries: further tries after a transient download error (0: none).
        backoff: seconds before the first retry; doubled for each next one (with
            jitter), all sleeps together at most 60 s.
        url: a URL of the shards, if known: which client reads them (fsspec, or obstore
            for ``s3://``: :mod:`evenly.sources._obstore`) is decided now, in this
            process, and kept by the copies pickled to workers and ranks (else each
            process decides from ``$EVENLY_OBSTORE``).
    """

    def __init__(
        self,
        cache_dir: str,
        max_bytes: int | None = None,
        storage_options: dict[str, Any] | None = None,
        max_in_flight: int | None = None,
        retries: int = RETRIES,
        backoff: float = BACKOFF,
        url: str | None = None,
    ) -> None:
        if max_bytes is None:
            max_bytes = int(os.environ.get("EVENLY_CACHE_BYTES", DEFAULT_CACHE_BYTES))
        if max_bytes < 1:
            raise ValueError(f"cache max_bytes must be >= 1, got {max_bytes}")
        if retries < 0 or backoff < 0:
            raise ValueError(
                f"cache retries and backoff must be >= 0, got retries={retries}, backoff={backoff}"
            )
        self.cache_dir = os.path.abspath(os.path.join(cache_dir, "shards"))
        self.max_bytes = int(max_bytes)
        #: the bound: every name but locks is a shard (or its ``.part-`` download)
        self._lru = LruDir(self.cache_dir, self.max_bytes)
        self.storage_options = dict(storage_options or {})
        self.max_in_flight = max_in_flight_setting(max_in_flight)
        self.retries = int(retries)
        self.backoff = float(backoff)
        self._fetcher: Fetcher | None = None
        self._mutex = threading.Lock()
        self._count_lock = threading.Lock()
        self._pid = os.getpid()
        #: shards this process downloaded (a hit, or a wait on another process, is not one)
        self.downloads = 0
        self._counters: dict[str, float] = {}
        #: read ``s3://`` with obstore (True), fsspec (False), or as each process decides
        self.obstore: bool | None = None if url is None else chosen(url, self.storage_options)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(_fetcher=None, _mutex=None, _count_lock=None, downloads=0, _counters={})
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update({"obstore": None, **state})
        self._mutex = threading.Lock()
        self._count_lock = threading.Lock()
        self._pid = os.getpid()

    def _after_fork(self) -> Fetcher:
        """This process's download threads (made on first use).  A forked worker
        inherits the parent's scheduler but none of its threads: it starts afresh
        rather than wait on downloads no thread of it will ever run."""
        self._forked()
        fetcher = self._fetcher
        if fetcher is None:
            with self._mutex:
                if self._fetcher is None:
                    self._fetcher = Fetcher(self, self.max_in_flight)
                fetcher = self._fetcher
        return fetcher

    def _forked(self) -> None:
        """In a forked child: no scheduler, counters or locks of the parent's (a lock
        its threads held at the fork would never be released)."""
        if os.getpid() != self._pid:
            self._fetcher, self._mutex, self._counters = None, threading.Lock(), {}
            self._count_lock = threading.Lock()
            self.downloads = 0
            self._pid = os.getpid()

    # ---- counters ------------------------------------------------------------------
    def count(self, **values: float) -> None:
        """Add to this process's fetch counters (``downloads``: shards downloaded)."""
        self._forked()
        with self._count_lock:
            for name, value in values.items():
                if name == "downloads":
                    self.downloads += int(value)
                else:
                    self._counters[name] = self._counters.get(name, 0) + value

    def stats(self) -> dict[str, float]:
        """This process's fetch counters: bytes received (``bytes_fetched``), requests
        (``fetch_requests``: whole downloads and range reads, retries included),
        seconds readers waited for a download (``fetch_seconds``), retries
        (``fetch_retries``) and the most requests it had in flight at once
        (``max_in_flight_seen``)."""
        self._forked()
        with self._count_lock:
            out = {name: self._counters.get(name, 0) for name in FETCH_COUNTERS}
        fetcher = self._fetcher
        out["max_in_flight_seen"] = fetcher.max_in_flight_seen if fetcher is not None else 0
        return out

    # ---- paths -----------------------------------------------------------------
    def path_for(self, url: str, fingerprint: str = "") -> str:
        """The local path of ``url``'s copy (it may not exist yet)."""
        digest = hashlib.sha256(f"{url}\n{fingerprint}".encode()).hexdigest()[:24]
        base = _SAFE.sub("_", url.rstrip("/").rsplit("/", 1)[-1])[-80:].lstrip(".") or "shard"
        path = os.path.abspath(os.path.join(self.cache_dir, f"{digest}-{base}"))
        if os.path.commonpath([path, self.cache_dir]) != self.cache_dir:
            raise ValueError(
                f"cache path {path!r} for {url!r} escapes the cache dir {self.cache_dir!r}"
            )
        return path

    # ---- fetching --------------------------------------------------------------
    def fetch(self, url: str, fingerprint: str = "", size: int | None = None) -> str:
        """Return a local path holding ``url``, downloading it once per machine.

        ``size`` (the listed size, if known) is checked before the copy is renamed
        into place.
        """
        return self._after_fork().wait(url, fingerprint, size)

    def download_whole(self, url: str, target: str, size: int | None, fingerprint: str) -> None:
        """One checked download of ``url`` into ``target`` (the caller holds its lock)."""
        self._download(url, target, size, fingerprint)  # counts it, its requests and bytes

    def open_ranged(self, url: str, fingerprint: str, size: int | None) -> tuple[Any, int]:
        """``url`` opened for range reads at the listed version (checked), and its size."""

        def attempt() -> _Ranged | _StoreRanged:
            try:
                store = store_for(url, self.storage_options, self.obstore)
                if store is not None:
                    return _StoreRanged(store, url, fingerprint, size)
                fs, path = filesystem(url, self.storage_options)
                return _Ranged(fs, path, url, fingerprint, size)
            except FileNotFoundError:
                raise FileNotFoundError(f"shard not found: {url}") from None

        ranged = self.retrying(attempt, f"download {url}", f"the download of {url}")
        return ranged, ranged.size

    def write_part(self, url: str, ranged: Any, start: int, end: int, fd: int) -> None:
        """Bytes ``[start, end)`` of ``url`` through ``ranged`` written to the file ``fd``
        at ``start`` (a range request, retried after a transient error; a short body is
        one)."""
        tries = 0

        def attempt() -> int:
            nonlocal tries
            tries += 1
            got: int = ranged.read_into(start, end, fd)
            if got != end - start:
                raise ConnectionError(f"short read of {url} bytes {start}-{end}: {got} bytes came")
            return got

        try:
            got = self.retrying(attempt, f"download {url}", f"the download of {url}")
        finally:
            self.count(fetch_requests=tries)  # retries are counted by retrying()
        self.count(bytes_fetched=got)

    def _download(self, url: str, target: str, size: int | None, fingerprint: str) -> None:
        """Download ``url`` to ``target`` through a ``.part-`` file, retrying transient
        errors; the caller holds the shard's lock."""

        def attempt() -> None:
            tmp = part_path(target)
            try:
                store = store_for(url, self.storage_options, self.obstore)
                if store is not None:
                    _get_store(store, url, tmp, fingerprint, size, self.count)
                else:
                    fs, path = filesystem(url, self.storage_options)
                    _get(fs, path, url, tmp, fingerprint, size, self.count)
                got = os.path.getsize(tmp)
                if size is not None and got != size:
                    raise _size_error(url, got, size)
                self.count(downloads=1)  # before the shard appears: a reader of it sees it
                os.replace(tmp, target)
            except FileNotFoundError:
                raise FileNotFoundError(f"shard not found: {url}") from None
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)

        # _get counts each request and the bytes received; retrying() counts the retries
        self.retrying(attempt, f"download {url}", f"the download of {url}")

    def retrying(self, call: Callable[[], T], doing: str, what: str) -> T:
        """``call()``, tried again after a transient error (``retries`` more tries,
        ``backoff`` seconds doubling, with jitter, at most 60 s of sleeps); the last error
        raised as a ``ConnectionError`` saying what could not be done (``doing``: "download
        <url>"; ``what``, for the log: "the download of <url>").  Each retry is counted
        (``fetch_retries``); access refused (HTTP 403) is raised at once as a
        ``PermissionError`` naming what was refused and the likely cause."""

        def once() -> T:
            try:
                return call()
            except Exception as exc:
                if _refused(exc):
                    raise PermissionError(
                        f"cannot {doing}: access denied ({exc}): the credentials have likely "
                        f"expired (temporary credentials end after a while), or they do not "
                        f"allow reading it; refresh them (storage_options, or the "
                        f"environment) and resume from the last checkpoint"
                    ) from exc
                raise

        def retry(tries: int, delay: float, exc: Exception) -> None:
            logger.warning(
                "evenly: retrying %s in %.2f s (try %d of %d): %s: %s",
                what,
                delay,
                tries + 1,
                self.retries + 1,
                type(exc).__name__,
                exc,
            )
            self.count(fetch_retries=1)

        def give_up(exc: Exception, tries: int, seconds: float) -> ConnectionError:
            return ConnectionError(
                f"cannot {doing}: {type(exc).__name__}: {exc} (after {tries} tries in "
                f"{seconds:.1f} s); is the storage reachable? retries are set by "
                f"ShardCache(retries=, backoff=)"
            )

        return retrying(
            once, retries=self.retries, backoff=self.backoff, on_retry=retry, give_up=give_up
        )

    def prefetch(
        self,
        items: Iterable[tuple[str, str] | tuple[str, str, int | None]],
        now: bool = False,
    ) -> None:
        """Queue background downloads of ``(url, fingerprint[, size])`` not cached yet,
        in this order (the plan's look-ahead; ``now``: needed by the batch being read,
        ahead of it)."""
        self._after_fork().hint(
            ((it[0], it[1], it[2] if len(it) > 2 else None) for it in items), now=now
        )

    def wait(self, url: str, fingerprint: str = "", size: int | None = None) -> str:
        """The local path of ``url``, joining its background download if one is running
        (else downloading it first in the queue); errors raise in this thread."""
        return self.fetch(url, fingerprint, size)

    # ---- eviction --------------------------------------------------------------
    def usage(self) -> int:
        """Bytes in the cache: complete shards and downloads (running or abandoned)."""
        return self._lru.usage()

    def remove_abandoned(self) -> list[str]:
        """Remove ``.part-`` files whose download is not running (the process that wrote
        them is dead, or their shard's lock is free; another node's, once stale).
        Returns the paths removed."""
        return self._lru.remove_abandoned()

    def evict(self, keep: str | Collection[str] | None = None) -> list[str]:
        """Remove abandoned downloads, then least-recently-used shards (and decoded row
        groups) until at most ``max_bytes`` remain (downloads in progress count), never
        those in ``keep`` or pinned by a live process (its pin file: the shards it reads
        or will read next), nor the decoded row groups of those shards.  An evicted row
        group's shard is no longer retired (its marker removed: fetched again when
        needed).  Returns the paths removed."""
        kept = {keep} if isinstance(keep, str) else set(keep or ())
        kept.update(os.path.join(self.cache_dir, n) for n in pinned_elsewhere(self.cache_dir))
        self._forked()
        fetcher = self._fetcher
        if fetcher is not None:  # this process's pins as they are now, not as last published
            kept.update(fetcher.pinned())
        removed = self._lru.evict(_WithEntries(kept))[0]
        for path in removed:
            shard, mark, _ = os.path.basename(path).partition(ENTRY_MARK)
            if not mark:
                continue
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path + ".lock")
            self.restore(os.path.join(self.cache_dir, shard), wait=False)  # evict lock held
        return removed

    # ---- retired shards (remote Parquet: the rows kept decoded) ------------------------
    def seen(self, url: str, fingerprint: str, size: int | None) -> None:
        """``url`` was read without its cached copy (rows of it mapped, decoded by another
        process): it leaves this process's look-ahead for the shards read last, as a read
        of the copy would (else it stays pinned, and counted in the look-ahead, until the
        plan's hints have moved on), and a download of it still queued is dropped."""
        self._forked()
        fetcher = self._fetcher
        if fetcher is not None:
            fetcher.read_elsewhere(self.path_for(url, fingerprint), size)

    def decoding(self, url: str, fingerprint: str, nbytes: int) -> None:
        """``url``'s row groups are kept decoded beside its cached copy, ``nbytes`` in all
        (by its footer): this process's look-ahead (and, through its pin file, every
        other process's) counts them with the shard from now on, so that the downloads
        it starts leave room for them (see :meth:`Fetcher.decoded`)."""
        self._after_fork().decoded(self.path_for(url, fingerprint), int(nbytes))

    def retire(self, url: str, fingerprint: str, size: int | None) -> bool:
        """Drop the cached copy of ``url`` (``size`` bytes listed), whose rows are all
        kept decoded beside it: its file is replaced by an empty one (atomically: a
        process that has it open keeps reading it), which the look-ahead takes for
        cached.  Under the shard's lock: another process's eviction removes a ``.part-``
        file whose shard's lock is free (:meth:`remove_abandoned`), and would take the
        marker's before it is renamed into place (the shard then stays whole).  Returns
        whether it was retired now."""
        target = self.path_for(url, fingerprint)
        try:
            if not size or os.path.getsize(target) != size:
                return False  # not there, retired already, or not the listed object
            with FileLock(target + ".lock", timeout=_RETIRE_WAIT):
                if os.path.getsize(target) != size:
                    return False  # retired (or restored and fetched) meanwhile
                tmp = part_path(target)
                try:
                    with open(tmp, "wb"):
                        pass
                    os.replace(tmp, target)
                finally:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(tmp)
        except (OSError, Timeout):  # a read-only cache, a lock held long: the shard stays
            return False
        return True

    @staticmethod
    def retired(path: str, size: int | None) -> bool:
        """Whether the cached copy at ``path`` of an object of ``size`` bytes is a
        retired shard's marker (an empty file)."""
        try:
            return bool(size) and os.path.getsize(path) == 0
        except FileNotFoundError:
            return False

    def restore(self, path: str, wait: bool = True) -> None:
        """Remove the retired shard's marker at ``path`` (under the shard's lock, and only
        if it is still one), so the shard is fetched again when read; without ``wait``,
        not if another process holds that lock (it restores or fetches the shard)."""
        if not self.retired(path, 1):
            return
        with (
            contextlib.suppress(OSError, Timeout),
            FileLock(path + ".lock", timeout=-1 if wait else 0),
        ):
            if self.retired(path, 1):
                os.unlink(path)


class _WithEntries(frozenset[str]):
    """Paths an eviction keeps: these shards, and the decoded row groups named after
    them (``<shard>@...``)."""

    def __contains__(self, path: object) -> bool:
        if not isinstance(path, str):
            return False
        if frozenset.__contains__(self, path):
            return True
        head, mark, _ = os.path.basename(path).partition(ENTRY_MARK)
        return bool(mark) and frozenset.__contains__(
            self, os.path.join(os.path.dirname(path), head)
        )


class _Ranged:
    """An object opened for range reads at the version the listing gave: its ``info``
    compared with the listed fingerprint, and (s3fs) its ETag sent with every range
    request (``If-Match``), so a newer version fails the read instead of mixing in."""

    def __init__(self, fs: Any, path: str, url: str, fingerprint: str, size: int | None) -> None:
        self.fs, self.path, self.url, self.fingerprint = fs, path, url, fingerprint
        self.file = fs.open(path, "rb", block_size=_CHUNK, cache_type="none")
        try:
            opened = getattr(self.file, "size", None)
            if size is not None and opened is not None and int(opened) != size:
                raise _size_error(url, int(opened), size)
            if fingerprint:
                details = getattr(self.file, "details", None)
                now = object_fingerprint(details if isinstance(details, dict) else fs.info(path))
                if not same_version(fingerprint, now):
                    raise _changed(url, fingerprint, now)
        except BaseException:
            self.close()
            raise
        self.size = int(opened) if opened is not None else int(size or fs.size(path))

    def read(self, start: int, end: int) -> bytes:
        fetch = getattr(self.file, "_fetch_range", None)  # fsspec's range read of a file
        try:
            if fetch is not None:
                return bytes(fetch(start, end))
            return bytes(self.fs.cat_file(self.path, start=start, end=end))
        except OSError as exc:
            if _expired(exc):  # s3fs: the If-Match failed, a newer version was written
                raise _changed(self.url, self.fingerprint, "a newer version") from exc
            raise

    def read_into(self, start: int, end: int, fd: int) -> int:
        """:meth:`read`, written to the file ``fd`` at ``start``; the bytes written."""
        data = self.read(start, end)
        os.pwrite(fd, memoryview(data)[: end - start], start)  # never another part's bytes
        return len(data)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.file.close()


class _StoreRanged:
    """An object read by range with obstore at the version the listing gave: every
    request carries the listed ETag (``If-Match``), so none is asked for to open it;
    without one (or a size) the object's ``head`` is compared with the listing first."""

    def __init__(self, store: ObjectStore, url: str, fingerprint: str, size: int | None) -> None:
        self.store, self.url, self.fingerprint = store, url, fingerprint
        self.etag = listed_etag(fingerprint)
        if self.etag is None or size is None:
            got, version = store.head(url)
            if size is not None and got != size:
                raise _size_error(url, got, size)
            if fingerprint and not same_version(fingerprint, f"{got}:{version}"):
                raise _changed(url, fingerprint, f"{got}:{version}")
            size = got
        self.size = size

    def read_into(self, start: int, end: int, fd: int) -> int:
        """Bytes ``[start, end)`` streamed to the file ``fd`` at ``start``; the bytes that
        came."""
        try:
            return self.store.read_into(self.url, start, end, self.etag, fd)
        except VersionChanged as exc:
            raise _changed(self.url, self.fingerprint, "a newer version") from exc

    def close(self) -> None:
        pass


def _get_store(
    store: ObjectStore,
    url: str,
    tmp: str,
    fingerprint: str,
    size: int | None,
    count: Callable[..., None],
) -> None:
    """Copy ``url`` to ``tmp`` with obstore, from the version that was listed: one GET
    carrying the listed ETag (``If-Match``); the response's size and version compared
    with the listing before a byte is written; a body shorter than its object is a
    transient error (``count``: the cache's counter of requests and bytes)."""
    sent: list[int] = []

    def check(got: int, version: str) -> None:
        sent.append(got)
        if size is not None and got != size:
            raise _size_error(url, got, size)
        if fingerprint and not same_version(fingerprint, f"{got}:{version}"):
            raise _changed(url, fingerprint, f"{got}:{version}")

    count(fetch_requests=1)
    try:
        with open(tmp, "wb") as out:
            written = store.download(
                url, out, listed_etag(fingerprint), check, lambda n: count(bytes_fetched=n)
            )
    except VersionChanged as exc:
        raise _changed(url, fingerprint, "a newer version") from exc
    if sent and written != sent[0]:
        raise ConnectionError(f"short body: {written} of the {sent[0]} bytes of {url} came")


def _size_error(url: str, got: int, size: int) -> ValueError:
    return ValueError(
        f"the download of {url} has {got} bytes but the listing said {size}: the object "
        f"changed after the dataset was opened (or the transfer was cut); nothing was "
        f"cached: open the dataset again"
    )


def _get(
    fs: Any,
    path: str,
    url: str,
    tmp: str,
    fingerprint: str,
    size: int | None,
    count: Callable[..., None],
) -> None:
    """Copy ``path`` to ``tmp``, from the version of the object that was listed
    (``count``: the cache's counter of requests and bytes).

    With a ``fingerprint`` (``size:version`` from the listing), the object is opened
    (its ``info``: the version this download reads) and compared with it before a byte is
    copied; s3fs then sends that ETag with every range read (``If-Match``), so a version
    written during the download fails the read instead of mixing into the copy.  The
    filesystem instance is the process's own (kept across downloads): where no read
    carries the version (not s3fs), its cached listing of ``path`` is dropped first, so
    that the open asks the storage for the object as it is now."""
    if "s3" not in _protocols(fs):
        fs.invalidate_cache(path)
    if not fingerprint:  # nothing listed to compare with
        count(fetch_requests=1)
        fs.get_file(path, tmp)
        count(bytes_fetched=os.path.getsize(tmp))
        return
    try:
        with fs.open(path, "rb", block_size=_CHUNK, cache_type="none") as f:
            details = getattr(f, "details", None)  # what the open file reads (s3fs, gcsfs)
            now = object_fingerprint(details if isinstance(details, dict) else fs.info(path))
            opened = getattr(f, "size", None)
            if size is not None and opened is not None and int(opened) != size:
                raise _size_error(url, int(opened), size)
            if not same_version(fingerprint, now):
                raise _changed(url, fingerprint, now)
            with open(tmp, "wb") as out:
                while True:
                    if f.tell() < (getattr(f, "size", None) or 1 << 62):  # a range request
                        count(fetch_requests=1)
                    chunk = f.read(_CHUNK)
                    if not chunk:
                        break
                    out.write(chunk)
                    count(bytes_fetched=len(chunk))
    except OSError as exc:
        if _expired(exc):  # s3fs: the If-Match failed, a newer version was written
            raise _changed(url, fingerprint, "a newer version") from exc
        raise


def _changed(url: str, listed: str, now: str) -> ValueError:
    return ValueError(
        f"{url} changed since the dataset was opened (size:version {listed} when listed, "
        f"{now} now): its rows are not the ones the epoch was planned from; nothing was "
        f"cached (a changed remote object is an error, never re-listed by itself): open "
        f"the source again to read the new object"
    )


def _refused(exc: BaseException) -> bool:
    """Whether ``exc`` is the storage refusing the credentials (HTTP 403, as s3fs and
    botocore raise it), not a local file's permissions."""
    if isinstance(exc, PermissionError) and exc.filename is None:
        return True
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        response = getattr(e, "response", None)
        if isinstance(response, dict):
            return bool(response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 403)
        e = e.__cause__ or e.__context__
    return False


def _expired(exc: BaseException) -> bool:
    """Whether ``exc`` (or its cause) says the object changed under an open file."""
    e: BaseException | None = exc
    while e is not None:
        if type(e).__name__ == "FileExpired":
            return True
        e = e.__cause__
    return False


def _protocols(fs: Any) -> tuple[str, ...]:
    """The protocols of filesystem ``fs`` (``("s3", "s3a")`` for s3fs)."""
    protocol = getattr(fs, "protocol", ())
    return (protocol,) if isinstance(protocol, str) else tuple(protocol)
