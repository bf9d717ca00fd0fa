"""Reading samples of remote objects by byte range (the global shuffle from object
storage): the spans the next batches need, many requests in flight, neighbours
coalesced, every request checked against the version of the object that was listed.

- The reader is told the plan's coming sample order (:meth:`RangeReader.hint`, from the
  source's ``prefetch``).  When a batch is read, the spans of that batch are requested
  if they were not already, and once fewer than half of the next
  :data:`READ_AHEAD_BATCHES` batches (at most :data:`READ_AHEAD_BYTES` ahead) are
  requested, all of them are: the coming batches arrive while this one is decoded, and
  the spans sent together are coalesced together.  Nothing is written to disk.
- The spans of one object at most :data:`RANGE_GAP` bytes apart are read with one
  request (at most :data:`MAX_REQUEST` bytes, unless one span alone is larger); requests
  are sent in the order the plan needs them.
- At most ``limit`` requests per process are in flight: on s3fs (and any fsspec
  filesystem with an async implementation) and on obstore (``s3://`` where it is chosen:
  :mod:`evenly.sources._obstore`) as coroutines on fsspec's event loop, else on a thread
  pool.
- On S3 every request carries the listed ETag (``If-Match``): an object replaced since
  the source was opened fails the request, raised naming the URL (the tar header check
  and the listing at every pass start cover the other filesystems).  A transient error
  (connection reset, 5xx, 429, a short body) is retried by the source's cache policy.
"""

from __future__ import annotations

import asyncio
import errno
import math
import os
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import fsspec.asyn
import numpy as np
import numpy.typing as npt

from ._manifest import filesystem
from ._obstore import VersionChanged, listed_etag, store_for

__all__ = [
    "DEFAULT_MAX_IN_FLIGHT",
    "MAX_REQUEST",
    "RANGE_GAP",
    "READ_AHEAD_BATCHES",
    "READ_AHEAD_BYTES",
    "RangeReader",
    "per_process",
]

T = TypeVar("T")
I64 = npt.NDArray[np.int64]

#: spans of one object at most this far apart are read with one request (a tar member's
#: padding and the next header fit; a skipped 25 KiB sample does not)
RANGE_GAP = 8 << 10
#: the most one request reads (unless one span alone is larger)
MAX_REQUEST = 8 << 20
#: batches read ahead of the one being read
READ_AHEAD_BATCHES = 32
#: ... and at most this many bytes of spans ahead (per process)
READ_AHEAD_BYTES = 32 << 20
#: requests in flight per node when neither the cache nor ``$EVENLY_MAX_IN_FLIGHT`` says
DEFAULT_MAX_IN_FLIGHT = 16
#: connections of an S3 client unless its ``config_kwargs`` say (botocore's default)
_S3_POOL = 10


def per_process(max_in_flight: int | None, readers: int) -> int:
    """This process's share of the node's ``max_in_flight`` requests: divided among the
    node's ranks (``$LOCAL_WORLD_SIZE``, else 1) and each rank's ``readers``, at least 1.

    >>> per_process(16, 2), per_process(16, 0), per_process(3, 4)
    (8, 16, 1)
    """
    if max_in_flight is None:
        max_in_flight = int(os.environ.get("EVENLY_MAX_IN_FLIGHT", DEFAULT_MAX_IN_FLIGHT))
    try:
        ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        ranks = 1
    return max(1, math.ceil(max_in_flight / (ranks * max(1, readers))))


@dataclass
class _Request:
    """One range request: bytes ``lo..hi`` of shard ``k``; ``data`` once it arrived."""

    k: int
    lo: int
    hi: int
    future: Future[bytes]
    data: bytes | None = None


class RangeReader:
    """Samples' byte spans of remote shards, fetched by range ahead of their batch.

    Args:
        urls, fingerprints: the shards and their listed ``size:version``.
        storage_options: for fsspec.
        spans: global sample indices -> ``(shard, lo, hi)`` arrays (the bytes a sample
            needs; ``hi == lo`` for a sample with none).
        retrying: ``retrying(call, doing, what)``, the cache's retry policy.
        limit: requests in flight in this process.
        obstore: read ``s3://`` with obstore (the shard cache's choice; None: as
            ``$EVENLY_OBSTORE`` says): :mod:`evenly.sources._obstore`.
    """

    def __init__(
        self,
        urls: Sequence[str],
        fingerprints: Sequence[str],
        storage_options: dict[str, Any],
        spans: Callable[[I64], tuple[I64, I64, I64]],
        retrying: Callable[[Callable[[], bytes], str, str], bytes],
        limit: int,
        obstore: bool | None = None,
    ) -> None:
        self.urls = tuple(urls)
        self.fingerprints = tuple(fingerprints)
        self.spans = spans
        self.retrying = retrying
        self.limit = max(1, int(limit))
        #: obstore's client where it reads ``s3://`` (:mod:`evenly.sources._obstore`)
        self._store = store_for(self.urls[0], storage_options, obstore)
        self._fs: Any = None
        self._path: list[str] = []
        #: the event loop the requests run on (fsspec's: obstore's coroutines run there too)
        self._loop: Any = None
        if self._store is not None:
            self._s3, self._async = True, True
            self._loop = fsspec.asyn.get_loop()
        else:
            self._fs, self._path = self._filesystem(dict(storage_options))
            self._s3 = "s3" in _protocols(self._fs)
            self._async = bool(getattr(self._fs, "async_impl", False))
            self._loop = getattr(self._fs, "loop", None)
        self._sem: asyncio.Semaphore | None = None
        self._pool: ThreadPoolExecutor | None = None
        #: the plan's coming sample order, from ``hint``; ``_cursor``: the next to read
        self._plan: I64 = np.zeros(0, dtype=np.int64)
        self._cursor = 0
        #: sample -> (its request, lo, hi): requested, not read yet
        self._pending: dict[int, tuple[_Request, int, int]] = {}
        self._lock = threading.Lock()
        self._counters = {"bytes_fetched": 0.0, "fetch_requests": 0.0, "fetch_seconds": 0.0}
        #: the process this reader belongs to (a forked child makes its own)
        self.pid = os.getpid()

    def _filesystem(self, options: dict[str, Any]) -> tuple[Any, list[str]]:
        """The process's filesystem instance (:func:`~evenly.sources._manifest.filesystem`:
        its client made once per process, a new one costs a fraction of a second), with
        a connection for every request in flight."""
        fs, _ = filesystem(self.urls[0], options)
        config = dict(options.get("config_kwargs") or {})
        pool = int(config.get("max_pool_connections", _S3_POOL))
        if "s3" in _protocols(fs) and self.limit > pool:
            config["max_pool_connections"] = self.limit
            fs, _ = filesystem(self.urls[0], {**options, "config_kwargs": config})
        return fs, [str(fs._strip_protocol(u)) for u in self.urls]

    # ---- the plan ------------------------------------------------------------------
    def hint(self, indices: Sequence[int] | I64) -> None:
        """The plan's next samples, in the order they will be read (appended)."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if not idx.size:
            return
        with self._lock:
            rest = self._plan[self._cursor :]
            self._plan = np.concatenate([rest, idx]) if rest.size else idx.copy()
            self._cursor = 0

    def restart(self) -> None:
        """A new pass: forget the plan announced so far and what was read ahead for it."""
        with self._lock:
            self._plan = np.zeros(0, dtype=np.int64)
            self._cursor = 0
        self._pending.clear()

    def _advance(self, idx: I64) -> None:
        """Move the cursor past ``idx`` where the plan holds it (a batch the plan did not
        announce leaves it where it is)."""
        plan, at = self._plan, self._cursor
        if np.array_equal(plan[at : at + idx.size], idx):
            self._cursor = at + idx.size
            return
        found = np.flatnonzero(plan[at:] == idx[-1])
        if found.size:
            self._cursor = at + int(found[0]) + 1

    def _ahead(self, batch: int) -> I64:
        """The samples after the cursor to have in flight: the next batches, bounded."""
        plan = self._plan[self._cursor : self._cursor + READ_AHEAD_BATCHES * max(1, batch)]
        if not plan.size:
            return plan
        _, lo, hi = self.spans(plan)
        within = np.cumsum(hi - lo) <= READ_AHEAD_BYTES
        return plan[: int(np.argmin(within)) if not within.all() else plan.size]

    # ---- reading -------------------------------------------------------------------
    def read(self, idx: I64, remote: Callable[[int], bool]) -> dict[tuple[int, int], bytes]:
        """The spans of samples ``idx`` in shards where ``remote(k)``, keyed by ``(shard,
        lo)``; the next batches' spans are requested before this returns."""
        if not idx.size:
            return {}
        with self._lock:
            self._advance(idx)
            ahead = self._ahead(idx.size)
        # refilled by halves: the samples sent together are coalesced together
        queued = sum(i in self._pending for i in ahead.tolist())
        self._submit(idx if 2 * queued >= ahead.size else np.concatenate([idx, ahead]), remote)
        keep = set(idx.tolist()) | set(ahead.tolist())
        for i in [i for i in self._pending if i not in keep]:
            del self._pending[i]  # announced, then not read (another pass): let it go
        started = time.perf_counter()
        out: dict[tuple[int, int], bytes] = {}
        try:
            for i in dict.fromkeys(idx.tolist()):
                entry = self._pending.pop(i, None)
                if entry is None:
                    continue  # no bytes (a sample with no member), or a local shard
                request, lo, hi = entry
                data = self._result(request)
                out[request.k, lo] = data[lo - request.lo : hi - request.lo]
        finally:
            with self._lock:
                self._counters["fetch_seconds"] += time.perf_counter() - started
        return out

    def counters(self) -> dict[str, float]:
        """``bytes_fetched``, ``fetch_requests`` and ``fetch_seconds`` (time a read
        waited for its bytes) of this process, cumulative."""
        with self._lock:
            return dict(self._counters)

    def _submit(self, want: I64, remote: Callable[[int], bool]) -> None:
        """Request the spans of ``want`` not requested yet, coalesced per shard, in the
        order ``want`` needs them."""
        _, first = np.unique(want, return_index=True)
        order = np.sort(first)
        new = want[order]
        fresh = np.fromiter((i not in self._pending for i in new.tolist()), bool, new.size)
        new, rank = new[fresh], order[fresh]
        if not new.size:
            return
        k, lo, hi = self.spans(new)
        shards = np.unique(k)
        usable = np.isin(k, [s for s in shards.tolist() if remote(s)]) & (hi > lo)
        new, rank, k, lo, hi = new[usable], rank[usable], k[usable], lo[usable], hi[usable]
        if not new.size:
            return
        by = np.lexsort((lo, k))
        new, rank, k, lo, hi = new[by], rank[by], k[by], lo[by], hi[by]
        reach = _reach(k, hi)
        gap = np.concatenate([[True], (k[1:] != k[:-1]) | (lo[1:] > reach[:-1] + RANGE_GAP)])
        starts = _cap(np.flatnonzero(gap), lo, reach)
        ends = np.append(starts[1:], new.size)
        runs = []
        for a, b in zip(starts.tolist(), ends.tolist(), strict=True):
            runs.append((int(rank[a:b].min()), a, b))
        runs.sort()
        for _, a, b in runs:
            request = self._request(int(k[a]), int(lo[a]), int(reach[b - 1]))
            for j in range(a, b):
                self._pending[int(new[j])] = (request, int(lo[j]), int(hi[j]))

    def _request(self, k: int, lo: int, hi: int) -> _Request:
        if self._async:
            future: Future[bytes] = asyncio.run_coroutine_threadsafe(
                self._limited(self._get_async(k, lo, hi)), self._loop
            )
        else:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.limit, thread_name_prefix="evenly-range")
            future = self._pool.submit(self._get_sync, k, lo, hi)
        future.add_done_callback(self._arrived)
        return _Request(k, lo, hi, future)

    def _arrived(self, future: Future[bytes]) -> None:
        """Count a request that completed (in the thread that completed it)."""
        if future.cancelled() or future.exception() is not None:
            return
        self._count(len(future.result()))

    def _count(self, nbytes: int) -> None:
        with self._lock:
            self._counters["fetch_requests"] += 1
            self._counters["bytes_fetched"] += nbytes

    def _result(self, request: _Request) -> bytes:
        """The request's bytes: waited for, or fetched again here after a transient error
        (the cache's retry policy); counted once."""
        if request.data is not None:
            return request.data
        try:
            request.data = request.future.result()
        except ValueError:  # the object changed (named): never retried
            raise
        except Exception as exc:
            from ._cache import is_transient

            if not is_transient(exc):
                raise
            k, lo, hi = request.k, request.lo, request.hi
            span = f"bytes {lo}..{hi} of {self.urls[k]}"

            def again() -> bytes:
                data = self._get_sync(k, lo, hi)
                self._count(len(data))
                return data

            request.data = self.retrying(again, f"read {span}", f"the read of {span}")
        return request.data

    # ---- one request ---------------------------------------------------------------
    async def _limited(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._sem is None:  # made on the loop's thread, as the loop runs it
            self._sem = asyncio.Semaphore(self.limit)
        async with self._sem:
            return await coro

    def _etag(self, k: int) -> str | None:
        """The listed ETag of shard ``k`` (quoted, as S3 lists it), if the listing had one."""
        return listed_etag(self.fingerprints[k])

    async def _get_async(self, k: int, lo: int, hi: int) -> bytes:
        if self._store is not None:
            try:
                data = await self._store.read_async(self.urls[k], lo, hi, self._etag(k))
            except VersionChanged as exc:
                raise self._changed(k) from exc
            return self._checked(data, k, lo, hi)
        fs, path = self._fs, self._path[k]
        etag = self._etag(k) if self._s3 else None
        try:
            if etag is None:
                data = await fs._cat_file(path, start=lo, end=hi)
            else:
                bucket, key, _ = fs.split_path(path)
                response = await fs._call_s3(
                    "get_object", Bucket=bucket, Key=key, Range=f"bytes={lo}-{hi - 1}", IfMatch=etag
                )
                try:
                    data = await response["Body"].read()
                finally:
                    response["Body"].close()
        except OSError as exc:
            if _changed(exc):
                raise self._changed(k) from exc
            raise
        return self._checked(bytes(data), k, lo, hi)

    def _get_sync(self, k: int, lo: int, hi: int) -> bytes:
        if self._store is not None:
            try:
                data = self._store.read(self.urls[k], lo, hi, self._etag(k))
            except VersionChanged as exc:
                raise self._changed(k) from exc
            return self._checked(data, k, lo, hi)
        if self._async:
            return asyncio.run_coroutine_threadsafe(self._get_async(k, lo, hi), self._loop).result()
        data = self._fs.cat_file(self._path[k], start=lo, end=hi)
        return self._checked(bytes(data), k, lo, hi)

    def _checked(self, data: bytes, k: int, lo: int, hi: int) -> bytes:
        if len(data) != hi - lo:  # a cut transfer: transient (retried)
            raise ConnectionError(
                f"short body: {len(data)} of the {hi - lo} bytes {lo}..{hi} of {self.urls[k]}"
            )
        return data

    def _changed(self, k: int) -> ValueError:
        from ._cache import _changed as changed

        return changed(self.urls[k], self.fingerprints[k], "a newer version")

    def close(self) -> None:
        """Stop the thread pool (requests in flight on the event loop finish alone)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        self._pending.clear()


def _protocols(fs: Any) -> tuple[str, ...]:
    protocol = fs.protocol
    return (protocol,) if isinstance(protocol, str) else tuple(protocol)


def _changed(exc: BaseException) -> bool:
    """Whether ``exc`` (or its cause) is S3's answer to an ``If-Match`` that failed."""
    e: BaseException | None = exc
    while e is not None:
        if isinstance(e, OSError) and e.errno == errno.EINVAL and "pre-condition" in str(e):
            return True
        response = getattr(e, "response", None)
        if isinstance(response, dict) and response.get("Error", {}).get("Code") in (
            "PreconditionFailed",
            "412",
        ):
            return True
        e = e.__cause__
    return False


def _reach(k: I64, hi: I64) -> I64:
    """The running maximum of ``hi`` within each shard (spans sorted by shard, lo)."""
    base = k.astype(np.int64) << 42
    reach: I64 = np.maximum.accumulate(base + hi) - base
    return reach


def _cap(starts: I64, lo: I64, reach: I64) -> I64:
    """Run starts, with a run cut where it would pass :data:`MAX_REQUEST` bytes."""
    ends = np.append(starts[1:], lo.size)
    long = np.flatnonzero(reach[ends - 1] - lo[starts] > MAX_REQUEST)
    if not long.size:
        return starts
    cuts = []
    for a, b in zip(starts[long].tolist(), ends[long].tolist(), strict=True):
        low = int(lo[a])
        for j in range(a + 1, b):
            if int(reach[j]) - low > MAX_REQUEST:
                cuts.append(j)
                low = int(lo[j])
    return np.union1d(starts, np.asarray(cuts, dtype=np.int64))
