"""A bounded local cache of remote shards, shared by every process on the machine.

- A shard is downloaded with fsspec to a temp file in the cache dir, then renamed into
  place: a partial download is never visible under the shard's name.
- An ``fcntl`` lock per shard makes two workers (or two ranks) on one machine wait for
  one download instead of doing two.
- After each download, files are evicted least-recently-used first (by mtime, which a
  hit refreshes) until the cache holds at most ``max_bytes``; the shard just fetched is
  never evicted.  A reader that still has an evicted file open keeps reading it (POSIX).
- ``prefetch(urls)`` downloads shards in a background thread.

Cache file names are a hash of (URL, fingerprint) plus a sanitised base name, so they
never escape the cache dir and a changed remote file is fetched again.

>>> cache = ShardCache("/tmp/evenly-cache-doctest", max_bytes=1 << 30)
>>> cache.max_bytes
1073741824
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import threading
import uuid
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from fsspec.core import url_to_fs

__all__ = ["DEFAULT_CACHE_BYTES", "ShardCache"]

#: Default cache size limit: 8 GiB (``$EVENLY_CACHE_BYTES`` overrides it).
DEFAULT_CACHE_BYTES = 8 << 30
_SAFE = re.compile(r"[^A-Za-z0-9._-]+")


@contextlib.contextmanager
def _locked(path: str) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


class ShardCache:
    """Local copies of remote shards under ``cache_dir``, at most ``max_bytes`` in all.

    Picklable: the thread pool is made lazily in each process.

    Args:
        cache_dir: where the copies live (created if needed).
        max_bytes: the size limit; the cache may exceed it only by the shard in use.
        storage_options: passed to fsspec (endpoint, credentials...).
        prefetch_threads: background download threads per process.
    """

    def __init__(
        self,
        cache_dir: str,
        max_bytes: int | None = None,
        storage_options: dict[str, Any] | None = None,
        prefetch_threads: int = 2,
    ) -> None:
        if max_bytes is None:
            max_bytes = int(os.environ.get("EVENLY_CACHE_BYTES", DEFAULT_CACHE_BYTES))
        if max_bytes < 1:
            raise ValueError(f"cache max_bytes must be >= 1, got {max_bytes}")
        self.cache_dir = os.path.abspath(os.path.join(cache_dir, "shards"))
        self.max_bytes = int(max_bytes)
        self.storage_options = dict(storage_options or {})
        self.prefetch_threads = prefetch_threads
        self._pool: ThreadPoolExecutor | None = None
        self._pending: dict[str, Future[str]] = {}
        self._mutex: threading.Lock | None = None
        self._pid = os.getpid()
        #: shards this process downloaded (a hit, or a wait on another process, is not one)
        self.downloads = 0

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(_pool=None, _pending={}, _mutex=None, downloads=0)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._pid = os.getpid()

    def _after_fork(self) -> None:
        """A forked worker inherits the parent's pool object but none of its threads:
        start afresh rather than wait on futures no thread will ever run."""
        if os.getpid() != self._pid:
            self._pool, self._pending, self._mutex = None, {}, None
            self._pid = os.getpid()

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
    def fetch(self, url: str, fingerprint: str = "") -> str:
        """Return a local path holding ``url``, downloading it once per machine."""
        target = self.path_for(url, fingerprint)
        if os.path.exists(target):
            _touch(target)
            return target
        os.makedirs(self.cache_dir, exist_ok=True)
        with _locked(target + ".lock"):
            if os.path.exists(target):  # another process fetched it while we waited
                _touch(target)
                return target
            tmp = f"{target}.part-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            fs, path = url_to_fs(url, **self.storage_options)
            try:
                fs.get_file(path, tmp)
                os.replace(tmp, target)
                self.downloads += 1
            except FileNotFoundError:
                raise FileNotFoundError(f"shard not found: {url}") from None
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
        self.evict(keep=target)
        return target

    def prefetch(self, items: Iterable[tuple[str, str]]) -> None:
        """Start background downloads of ``(url, fingerprint)`` pairs not cached yet."""
        self._after_fork()
        if self._mutex is None:
            self._mutex = threading.Lock()
        with self._mutex:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    max_workers=self.prefetch_threads, thread_name_prefix="evenly-prefetch"
                )
            for url, fp in items:
                if url in self._pending and not self._pending[url].done():
                    continue
                if os.path.exists(self.path_for(url, fp)):
                    continue
                self._pending[url] = self._pool.submit(self.fetch, url, fp)

    def wait(self, url: str, fingerprint: str = "") -> str:
        """``fetch``, joining a background download of ``url`` if one is running."""
        self._after_fork()
        future = self._pending.pop(url, None)
        if future is not None:
            with contextlib.suppress(Exception):  # fetch again below, raising in this thread
                return future.result()
        return self.fetch(url, fingerprint)

    # ---- eviction --------------------------------------------------------------
    def usage(self) -> int:
        """Bytes of complete shards in the cache."""
        return sum(size for _, _, size in self._files())

    def _files(self) -> list[tuple[float, str, int]]:
        out = []
        try:
            names = os.listdir(self.cache_dir)
        except FileNotFoundError:
            return []
        for name in names:
            if name.endswith(".lock") or ".part-" in name:
                continue
            path = os.path.join(self.cache_dir, name)
            with contextlib.suppress(FileNotFoundError):
                st = os.stat(path)
                out.append((st.st_mtime, path, st.st_size))
        return out

    def evict(self, keep: str | None = None) -> list[str]:
        """Remove least-recently-used shards until at most ``max_bytes`` remain."""
        removed: list[str] = []
        with _locked(os.path.join(self.cache_dir, ".evict.lock")):
            files = sorted(self._files())
            total = sum(size for _, _, size in files)
            for _, path, size in files:
                if total <= self.max_bytes:
                    break
                if path == keep:
                    continue
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                    removed.append(path)
                total -= size
        return removed


def _touch(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.utime(path)
