"""What every file-format source shares: shard list, manifest, global index, cache,
batched reads grouped by shard, and error messages that name the file and the sample."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import os
import posixpath
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from ._cache import ShardCache
from ._cachedir import cache_subdir
from ._manifest import (
    FileEntry,
    Shards,
    default_cache_dir,
    load_entries,
    local_fingerprint,
    relist,
    resolve,
    same_version,
)

__all__ = ["Paths", "RowError", "ShardedSource"]

Paths = str | os.PathLike[str] | Sequence[str | os.PathLike[str]]

#: the first pass start within this many seconds of the listing made when a remote
#: source was opened (in the process that opened it) does not list its shards again:
#: that listing is the storage as it is now, and every read of a shard not cached checks
#: the version it gave (see :meth:`ShardedSource.check_unchanged`)
FRESH_LISTING_SECONDS = 30.0


class RowError(ValueError):
    """Raised by a format's ``_read`` for one row of its shard, so the error names that
    sample (not the first one of the batch).

    >>> RowError(7, "line 8 is not valid JSON").row
    7
    """

    def __init__(self, row: int, message: str) -> None:
        super().__init__(message)
        self.row = int(row)


class ShardedSource:
    """A random-access source over a list of shard files (subclasses read one format).

    Global index ``i`` is row ``i - start[k]`` of shard ``k``, shards in sorted URL order.
    Subclasses define ``format``, ``extensions``, ``_scan(k, url)`` (row count and meta
    of one shard) and ``_read(k, handle, rows)`` (those rows of shard ``k``, in order;
    a failure of one row raises :class:`RowError` naming it).
    """

    format: ClassVar[str] = ""
    extensions: ClassVar[tuple[str, ...]] = ()
    #: files kept open per process
    max_open_files: ClassVar[int] = 64

    def __init__(
        self,
        paths: Paths,
        *,
        storage_options: dict[str, Any] | None = None,
        cache_dir: str | None = None,
        cache_bytes: int | None = None,
        max_in_flight: int | None = None,
        use_manifest: bool = True,
        keep_entries: bool = False,
    ) -> None:
        listed = time.monotonic()
        shards = resolve(paths, self.extensions, storage_options, what=self._what)
        self._shards: Shards = shards
        #: (process, time) of the listing made at the open, until the first pass start
        self._fresh_listing: tuple[int, float] | None = (
            (os.getpid(), listed) if shards.remote else None
        )
        self.urls: tuple[str, ...] = shards.urls
        #: the cache directory given (None: ``$EVENLY_CACHE_DIR`` or ``~/.cache/evenly``):
        #: remote shards, manifests, decoded row groups, packing's lengths and plans
        self.cache_dir: str | None = cache_dir
        if shards.remote:  # made now: an unwritable cache_dir is named before any download
            cache_subdir("shards", cache_dir)
        self.cache: ShardCache | None = (
            ShardCache(
                cache_dir or default_cache_dir(),
                cache_bytes,
                shards.storage_options,
                max_in_flight=max_in_flight,
                url=shards.urls[0],
            )
            if shards.remote
            else None
        )
        if self.cache is not None and shards.retried:  # the listing helper's, at the open
            self.cache.count(fetch_retries=shards.retried)
        self._fingerprints: tuple[str, ...] = shards.fingerprints
        entries = load_entries(
            shards, self.format, self._scan_checked, cache_dir=cache_dir, use_cache=use_manifest
        )
        if shards.manifests is not None:  # read: not carried to every worker
            self._shards = dataclasses.replace(shards, manifests=None)
        self._starts = np.concatenate([[0], np.cumsum([e.num_rows for e in entries])]).astype(
            np.int64
        )
        self._sizes = tuple(int(n) for n in np.diff(self._starts))
        self._handles: OrderedDict[int, Any] = OrderedDict()
        self._pid = os.getpid()
        #: this process's cumulative I/O counters (``io_stats()``): what a format knows
        self._io: dict[str, float] = {}
        self._setup(entries)
        #: the manifest entries, if asked for (``evenly.write`` saves them): they can be
        #: large (offsets of every member or line), and ``_setup`` keeps a compact copy
        self.entries: list[FileEntry] | None = entries if keep_entries else None

    @property
    def _what(self) -> str:
        return f"evenly.from_{self.format}"

    # ---- subclass hooks ----------------------------------------------------------
    def _scan(self, k: int, url: str) -> tuple[int, dict[str, Any]]:
        raise NotImplementedError

    def _setup(self, entries: list[FileEntry]) -> None:
        """Keep what reads need from the entries; check they agree (schemas...)."""

    def _open(self, k: int, path: str) -> Any:
        raise NotImplementedError

    def _read(self, k: int, handle: Any, rows: npt.NDArray[np.int64]) -> list[Any]:
        raise NotImplementedError

    def _count(self, **values: float) -> None:
        """Add to this process's I/O counters (``bytes_read``, ``cache_hits`` ...)."""
        io = self._io
        for name, value in values.items():
            io[name] = io.get(name, 0) + value

    def io_stats(self) -> dict[str, float]:
        """This process's cumulative I/O counters, for ``loader.stats()``: those the
        format knows of ``bytes_read``, ``bytes_decoded``, ``decode_seconds``,
        ``cache_hits``, ``cache_misses``; for remote shards also the shard cache's
        (``bytes_fetched``, ``fetch_requests``, ``fetch_seconds``, ``fetch_retries``,
        ``max_in_flight_seen``: :meth:`ShardCache.stats`)."""
        out = dict(self._io)
        if self.cache is not None:
            out.update(self.cache.stats())
        return out

    def _fetch_waited(self) -> float:
        """Seconds this process has waited for remote shards so far (0 for local ones):
        a format that times its decoding subtracts the waits inside it."""
        return 0.0 if self.cache is None else self.cache.stats()["fetch_seconds"]

    # ---- the Source protocol -----------------------------------------------------
    def __len__(self) -> int:
        return int(self._starts[-1])

    @property
    def shard_sizes(self) -> tuple[int, ...]:
        """Samples per shard, in index order (for the block shuffle)."""
        return self._sizes

    @property
    def fingerprint(self) -> str:
        """Identity of the data for checkpoints: format, shard file names and row counts.

        Paths and mtimes are left out, so a copy of the shards elsewhere (another mount,
        an upload to S3) resumes from the same checkpoint.
        """
        digest = hashlib.sha256(self.format.encode())
        for url, n in zip(self.urls, self.shard_sizes, strict=True):
            digest.update(f"\n{posixpath.basename(url)}:{n}".encode())
        return f"{self.format}:{len(self)}:{digest.hexdigest()[:16]}"

    def content_key(self) -> str:
        """The key of the data on this machine, for what evenly caches about it
        (packing's lengths): the format and each shard's URL and identity as opened
        (size, mtime, ctime and inode of a local file; size and ETag of an object).
        Unlike :attr:`fingerprint`, a copy or an in-place rewrite changes it."""
        digest = hashlib.sha256(self.format.encode())
        for url, identity, n in zip(self.urls, self._fingerprints, self._sizes, strict=True):
            digest.update(f"\n{url}\t{identity}\t{n}".encode())
        return f"{self.format}:{len(self)}:{digest.hexdigest()[:32]}"

    @property
    def preferred_shuffle(self) -> str:
        """``"block"`` for remote shards (reads stay within a few shards), else ``"global"``."""
        return "block" if self.cache is not None else "global"

    def _check_indices(self, indices: Sequence[int] | npt.NDArray[Any]) -> npt.NDArray[np.int64]:
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        n = len(self)
        if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= n):
            bad = int(idx[(idx < 0) | (idx >= n)][0])
            raise IndexError(f"{self._what}: sample index {bad} is out of range [0, {n})")
        return idx

    def shard_of(self, indices: Sequence[int] | npt.NDArray[Any]) -> npt.NDArray[np.int64]:
        """The shard number of each global index."""
        idx = self._check_indices(indices)
        return (np.searchsorted(self._starts, idx, side="right") - 1).astype(np.int64)

    def locate(self, index: int) -> str:
        """Where sample ``index`` lives, e.g. ``"s3://bucket/shard-00003.parquet row 17"``."""
        (k,) = self.shard_of([index]).tolist()
        return f"{self.urls[k]} row {int(index) - int(self._starts[k])}"

    def __getitem__(self, index: int) -> Any:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """Read a batch: each shard (and row group) once, samples in the order asked."""
        idx = self._check_indices(indices)
        shards = self.shard_of(idx)
        out: list[Any] = [None] * idx.size
        order = np.argsort(shards, kind="stable")
        present, first = np.unique(shards[order], return_index=True)
        if self.cache is not None and present.size > 1:
            self.cache.prefetch((self._remote(k) for k in present.tolist()), now=True)
        bounds = [*first.tolist(), idx.size]
        for j, k in enumerate(present.tolist()):
            where = order[bounds[j] : bounds[j + 1]]
            rows = idx[where] - self._starts[k]
            try:
                samples = self._read(k, self._handle(k), rows)
            except RowError as exc:
                raise self._error(exc, int(self._starts[k]) + exc.row) from exc
            except Exception as exc:
                raise self._error(exc, int(idx[where[0]])) from exc
            for pos, sample in zip(where.tolist(), samples, strict=True):
                out[pos] = sample
        return out

    def prefetch(self, indices: Sequence[int]) -> None:
        """Start downloading (remote only) the shards these indices need, in first-use order."""
        if self.cache is None or not len(indices):
            return
        shards = self.shard_of(indices)
        _, first = np.unique(shards, return_index=True)
        ordered = shards[np.sort(first)].tolist()
        self.cache.prefetch(self._remote(k) for k in ordered)

    # ---- files -------------------------------------------------------------------
    def check_unchanged(self) -> None:
        """Raise if a shard changed since the source was opened: reading it would serve
        other samples' bytes, fail past its end, or (remote) serve rows the epoch was not
        planned from.  Called at every pass start, for every shard, cached or not: a
        ``stat`` per local shard (size, mtime, ctime, inode); one fresh listing per
        directory of remote shards (size and ETag or version id: an object replaced with
        one of the same size is caught).  A changed remote object is an error, never
        re-listed silently: the user opens the source again.

        The first pass start within :data:`FRESH_LISTING_SECONDS` of the open's listing, in
        the process that opened the source, uses that listing instead of a second one
        (one request less before the first batch): a shard changed since is caught by its
        read, which checks the listed version (a cached copy is of that version); every
        later pass start lists again."""
        if self.cache is None:
            for k in range(len(self.urls)):
                self._check_shard(k)
            return
        fresh, self._fresh_listing = self.__dict__.get("_fresh_listing"), None
        if (
            fresh is not None
            and fresh[0] == os.getpid()
            and time.monotonic() - fresh[1] < FRESH_LISTING_SECONDS
        ):
            return
        now = self.cache.retrying(  # the one retry loop (counted): none in the helper
            lambda: relist(self._shards, retries=0),
            f"list the shards of {self._what}",
            f"the listing of {self._what}'s shards",
        )
        gone = [k for k, fp in enumerate(now) if fp is None]
        if gone:
            raise FileNotFoundError(
                f"{self._what}: shard {gone[0]} ({self.urls[gone[0]]}) was deleted or moved "
                f"since the source was opened{_others(len(gone))}; open the source again"
            )
        changed = [
            k
            for k, (then, fp) in enumerate(zip(self._fingerprints, now, strict=True))
            if not same_version(then, str(fp))
        ]
        if changed:
            k = changed[0]
            raise ValueError(
                f"{self._what}: shard {k} ({self.urls[k]}) changed since the source was opened "
                f"(size:version {self._fingerprints[k]} when listed, {now[k]} now)"
                f"{_others(len(changed))}: its rows are not the ones this epoch would be "
                f"planned from; a changed remote object is an error, never re-listed by "
                f"itself: open the source again to read the new objects"
            )

    def _check_shard(self, k: int) -> None:
        """Raise if local shard ``k`` changed since the source was opened."""
        url = self.urls[k]
        try:
            now = local_fingerprint(url)
        except FileNotFoundError:
            raise FileNotFoundError(
                f"{self._what}: shard {k} ({url}) was deleted or moved since the source was opened"
            ) from None
        if now != self._fingerprints[k]:
            raise ValueError(
                f"{self._what}: shard {k} ({url}) changed since the source was opened "
                f"(size:mtime:ctime:inode {self._fingerprints[k]} then, {now} now): "
                f"reading it would return other samples; open the source again"
            )

    def _remote(self, k: int) -> tuple[str, str, int | None]:
        """``(url, fingerprint, listed size)`` of shard ``k``, for the cache."""
        sizes = self._shards.sizes
        return self.urls[k], self._fingerprints[k], (sizes[k] or None) if sizes else None

    def local_path(self, k: int) -> str:
        """A local path of shard ``k``: itself, or its copy in the cache."""
        if self.cache is None:
            return self.urls[k]
        return self.cache.wait(*self._remote(k))

    def open_local(self, k: int) -> Any:
        """Shard ``k`` opened for binary reading (its cached copy if remote: fetched
        again if another process evicted it between the download and the open)."""
        try:
            return open(self.local_path(k), "rb")
        except FileNotFoundError:
            if self.cache is None:
                raise
            return open(self.local_path(k), "rb")

    def _handle(self, k: int) -> Any:
        if os.getpid() != self._pid:  # forked: never share file offsets with the parent
            self._handles = OrderedDict()
            self._pid = os.getpid()
        handle = self._handles.get(k)
        if handle is not None:
            self._handles.move_to_end(k)
            return handle
        path = self.local_path(k)
        if self.cache is not None and not os.path.exists(path):
            path = self.local_path(k)  # evicted by another process just now: fetch again
        if not os.path.exists(path):
            raise FileNotFoundError(f"shard not found: {self.urls[k]}")
        try:
            handle = self._open(k, path)
        except Exception:
            if self.cache is None:
                self._check_shard(k)  # rewritten while it was opened: say so
            raise
        self._handles[k] = handle
        while len(self._handles) > self.max_open_files:
            _, old = self._handles.popitem(last=False)
            _close(old)
        return handle

    def _scan_checked(self, k: int, url: str) -> tuple[int, dict[str, Any]]:
        try:
            return self._scan(k, url)
        except FileNotFoundError:
            raise FileNotFoundError(
                f"{self._what}: shard {k} not found: {url}; check the path, or remove it "
                f"from the list"
            ) from None
        except (ValueError, OSError) as exc:
            raise ValueError(f"{self._what}: cannot read shard {k} ({url}): {exc}") from exc

    def _error(self, exc: Exception, index: int) -> Exception:
        where = self.locate(index)
        if isinstance(exc, FileNotFoundError):
            return FileNotFoundError(
                f"{self._what}: cannot read sample {index} ({where}): the file is missing; "
                f"was it deleted or moved after the dataset was opened?"
            )
        what = "" if isinstance(exc, RowError) else f"{type(exc).__name__}: "
        return ValueError(f"{self._what}: cannot read sample {index} ({where}): {what}{exc}")

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_handles"] = OrderedDict()
        state["entries"] = None
        state["_fresh_listing"] = None  # another process (or thread) lists for itself
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._pid = os.getpid()

    def copy_for_thread(self) -> Any:
        """The source a reader thread reads (``worker_type="thread"``): a copy with its
        own open files and caches, as a worker process gets by pickling."""
        return copy.copy(self)

    def __repr__(self) -> str:
        where = "remote" if self.cache is not None else "local"
        return (
            f"{type(self).__name__}({len(self)} samples in {len(self.urls)} {where} "
            f"shard(s), first {self.urls[0]!r})"
        )

    def close(self) -> None:
        """Close the files this process holds open."""
        handles = self.__dict__.get("_handles")
        while handles:
            _close(handles.popitem()[1])

    def __del__(self) -> None:
        self.close()


def _others(n: int) -> str:
    """`` (and N other shards)`` when more than one shard is at fault."""
    return "" if n <= 1 else f" (and {n - 1} other shard{'s' if n > 2 else ''})"


def _close(handle: Any) -> None:
    close = getattr(handle, "close", None)
    if close is not None:
        close()
