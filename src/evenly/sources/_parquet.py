"""``evenly.from_parquet``: random access over Parquet shards, row group by row group.

A row group is decoded once per node into the decoded-row cache (Arrow IPC files, see
:mod:`evenly.sources._rowcache`) and memory-mapped by every worker of every rank: for a
local shard in ``<cache_dir>/rows`` (``decoded_cache_bytes``); for a remote one beside
the downloaded shard in the shard cache, within ``cache_bytes``, the shard itself dropped
once all its row groups are decoded (one copy per shard on disk).  With that cache off
(``decoded_cache_bytes=0``), decoded row groups stay Arrow tables in a per-process LRU
budgeted by their real buffer size.  Either way (remote, or the cache off) a process
keeps a row group only until the reads the loader announced have read all its rows.  A batch is one
lookup for the whole batch and one ``take`` (or per-row accessor) per row group present.
Every page read is checked against its CRC-32 when the file has page checksums
(:class:`VerifiedParquetFile`; ``evenly.write`` writes them): a flipped bit is an error
naming the file, the row group and the sample, never a value served.

>>> import os, tempfile, pyarrow as pa, pyarrow.parquet as pq
>>> d = tempfile.mkdtemp()
>>> pq.write_table(pa.table({"id": [0, 1, 2]}), os.path.join(d, "a.parquet"))
>>> pq.write_table(pa.table({"id": [3, 4]}), os.path.join(d, "b.parquet"))
>>> src = from_parquet(d, cache_dir=os.path.join(d, ".cache"))
>>> len(src), src[3], src.shard_sizes
(5, {'id': 3}, (3, 2))
>>> src.locate(4).endswith("b.parquet row 1")
True
>>> src.read_columns([4, 0])["id"].tolist()
[4, 0]
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.parquet as pq

from evenly.errors import EvenlyWarning

from ._base import Paths
from ._cachedir import CacheDirError, network_fs, unwritable, where_from
from ._columns import ArrowBatchSource, schema_meta
from ._gather import chunk_views
from ._manifest import FileEntry, filesystem, local_fingerprint
from ._rowcache import _TOUCH_EVERY, RowCache
from ._rowcache import decoded_cache_bytes as _decoded_cache_bytes
from ._rowviews import RowAccess

__all__ = ["ParquetSource", "VerifiedParquetFile", "from_parquet"]

#: Decoded row groups kept per process (bytes of Arrow buffers) when the decoded-row
#: cache is off; with it on, the bytes the per-row accessors add (the tables are mapped).
DEFAULT_ROW_GROUP_CACHE = 256 << 20
#: row groups a process keeps at hand (mapped or decoded), whatever their bytes
MAX_GROUPS = 4096
#: a remote shard's row groups are kept decoded in the shard cache when their columns'
#: decoded bytes are at most this many times their bytes in the file (by its footer):
#: the decoded copy then replaces the download at about its size
KEEP_DECODED_RATIO = 1.05
#: bytes a decoded row group may take beyond :data:`KEEP_DECODED_RATIO` times its stored
#: bytes and still be kept (Arrow's offsets and bitmaps, the entry's header)
KEEP_DECODED_SLACK = 8 << 10


class ParquetSource(ArrowBatchSource):
    """Parquet shards as one indexable source; a sample is a dict of the row's columns
    (numbers as Python scalars, lists of numbers as 1-D numpy arrays), and
    :meth:`read_columns` reads a whole batch as numpy columns.

    Build it with :func:`from_parquet`.
    """

    format = "parquet"
    extensions = (".parquet", ".parq", ".pq")

    def __init__(
        self,
        paths: Paths,
        *,
        columns: Sequence[str] | None = None,
        row_group_cache_bytes: int = DEFAULT_ROW_GROUP_CACHE,
        decoded_cache_bytes: int | None = None,
        **kwargs: Any,
    ) -> None:
        self.columns = None if columns is None else list(columns)
        self.row_group_cache_bytes = int(row_group_cache_bytes)
        #: (shard, row group) -> (Arrow table, its buffer bytes), least recent first
        self._groups: OrderedDict[tuple[int, int], tuple[pa.Table, int]] = OrderedDict()
        self._group_bytes = 0
        #: per-row accessors of the row groups in the LRU (evicted with them)
        self._group_access: dict[tuple[int, int], RowAccess | None] = {}
        #: numpy views of their columns (zero-copy; evicted with them)
        self._group_views: dict[tuple[int, int], list[npt.NDArray[Any]] | None] = {}
        #: when each kept row group's node cache entry is next due a recency refresh
        self._touch_due: dict[tuple[int, int], float] = {}
        #: remote shards whose row groups are kept decoded in the shard cache (or not)
        self._keep_decoded: dict[int, bool] = {}
        #: a remote shard's row groups' stored bytes (selected columns, by its footer)
        self._stored: dict[int, list[int]] = {}
        #: rows of each row group (global chunk number) that the reads announced by
        #: :meth:`prefetch` still have to read in this process (decoded row groups only)
        self._pending: dict[int, int] = {}
        super().__init__(paths, **kwargs)
        #: the node-local decoded-row cache (None: off); ``.hits`` / ``.misses`` count
        #: this process's lookups.  For remote shards its entries are the shard cache's,
        #: bounded with the shards by ``cache_bytes`` (a shard is dropped once decoded)
        self.decoded_cache: RowCache | None
        if self.cache is None:
            self.decoded_cache = _node_cache(kwargs.get("cache_dir"), decoded_cache_bytes)
        elif not _decoded_cache_bytes(decoded_cache_bytes):
            self.decoded_cache = None  # asked off: each worker decodes what it reads
        else:
            self.decoded_cache = RowCache(kwargs.get("cache_dir"), 1, store=self.cache)
            if decoded_cache_bytes:
                warnings.warn(
                    f"evenly: decoded_cache_bytes={decoded_cache_bytes} does not bound remote "
                    f"Parquet ({self.urls[0] if self.urls else paths!r}): its row groups are "
                    f"decoded once per node into the shard cache, which cache_bytes bounds "
                    f"(one copy per shard: the shard is dropped once decoded); drop "
                    f"decoded_cache_bytes to silence this (0 turns the decoded copy off)",
                    EvenlyWarning,
                    stacklevel=3,
                )

    def _scan(self, k: int, url: str) -> tuple[int, dict[str, Any]]:
        fs, path = filesystem(url, self._shards.storage_options)
        with fs.open(path, "rb", size=self._shards.sizes[k]) as f:
            head = f.read(4)
            if head != b"PAR1":
                raise ValueError(
                    f"it is not a Parquet file (it starts with {head!r}, not b'PAR1'); "
                    f"is the extension wrong?"
                )
            try:
                meta = pq.ParquetFile(f).metadata
            except (pa.ArrowInvalid, OSError) as exc:
                raise ValueError(f"truncated or corrupt Parquet file: {exc}") from exc
            groups = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
            schema = meta.schema.to_arrow_schema().remove_metadata()
        return int(meta.num_rows), {"row_groups": groups, **schema_meta(schema)}

    def _setup(self, entries: list[FileEntry]) -> None:
        self._setup_chunks(entries, "row_groups")

    def shuffle_advice(self, mode: str) -> str | None:
        """A word for the user when the global shuffle will decode a row group for
        almost every sample (local data larger than the row-group cache)."""
        data = sum(self._shards.sizes)
        if mode != "global" or self.cache is not None:
            return None
        if self.decoded_cache is not None:
            if data <= self.decoded_cache.max_bytes:
                return None
            return (
                f"evenly.from_parquet: a global shuffle over {data >> 20} MiB of Parquet with a "
                f"{self.decoded_cache.max_bytes >> 20} MiB decoded-row cache decodes a row "
                f"group for almost every sample (slow); use shuffle='block', Arrow files "
                f"(evenly.write(..., format='arrow')), or a larger decoded_cache_bytes"
            )
        if data <= self.row_group_cache_bytes:
            return None
        return (
            f"evenly.from_parquet: a global shuffle over {data >> 20} MiB of Parquet with a "
            f"{self.row_group_cache_bytes >> 20} MiB row-group cache decodes a row group for "
            f"almost every sample (slow); use shuffle='block', Arrow files "
            f"(evenly.write(..., format='arrow')), smaller row groups, or a larger "
            f"row_group_cache_bytes"
        )

    def prefetch(self, indices: Sequence[int]) -> None:
        """Start downloading the shards of ``indices`` (remote), and note the rows that
        this process's reader will read next: without the decoded-row cache, a decoded
        row group leaves the LRU as soon as the reads announced so far have read all
        their rows of it (in a block shuffle: once the reader has left its window), so
        the LRU holds the row groups still to be read, not ``row_group_cache_bytes``."""
        super().prefetch(indices)
        if (self.decoded_cache is not None and self.cache is None) or not len(indices):
            return  # local and mapped: the node's cache holds them, not the process
        chunks, counts = np.unique(
            self._chunk_of.of(self._rows(self._check_indices(indices))), return_counts=True
        )
        pending = self._pending
        for c, n in zip(chunks.tolist(), counts.tolist(), strict=True):
            pending[c] = pending.get(c, 0) + n

    def _finishing(self, chunk: npt.NDArray[np.int64], present: npt.NDArray[np.int64]) -> set[int]:
        """The row groups whose last announced rows this read reads: each is dropped as
        soon as its rows are out, so at a window's edge the old window's row groups go
        before the new one's are decoded."""
        pending = self._pending
        if not pending:
            return set()
        counts = np.bincount(np.searchsorted(present, chunk), minlength=present.size)
        return {
            c
            for c, n in zip(present.tolist(), counts.tolist(), strict=True)
            if pending.get(c, -1) == n
        }

    def _chunks_read(self, rows: npt.NDArray[np.int64]) -> None:
        if self._pending:  # nothing announced: nothing to count
            super()._chunks_read(rows)

    def _chunk_read(self, c: int, n: int) -> None:
        """``n`` rows of row group ``c`` were read: drop it once no announced read needs it."""
        pending = self._pending
        left = pending.get(c)
        if left is None:  # not announced (a read outside the plan's order)
            return
        if left > n:
            pending[c] = left - n
            return
        del pending[c]
        key = (int(self._cshard[c]), int(self._clocal[c]))
        if key in self._groups:
            self._drop(key)

    def _open(self, k: int, path: str) -> Any:
        return VerifiedParquetFile(path, self.urls[k])

    def _handle(self, k: int) -> Any:
        """Shard ``k`` is opened only when one of its row groups must be decoded, and
        closed right after (a process reading a warm decoded-row cache never opens it): an
        open ``ParquetFile`` keeps about a column chunk of heap after a read, 490 MiB per
        process over 64 shards of 8 MiB row groups.  A decode is rare (the row-group LRU
        and the decoded-row cache serve the rest), and opening costs a footer parse."""
        return _Deferred(self, k)

    def _chunk(self, k: int, g: int, handle: Any) -> pa.Table:
        """Row group ``g`` of shard ``k`` as an Arrow table: from the process's LRU, else
        mapped from the node's decoded-row cache (decoded into it first if no process
        has), else (cache off) decoded now; the LRU is budgeted by the tables' real buffer
        sizes (0 for mapped ones: the page cache holds them), so the budget is the
        memory held."""
        key = (k, g)
        hit = self._groups.get(key)
        cache = self.decoded_cache
        if hit is not None:
            self._hit(key)
            return hit[0]
        if cache is not None and self._keep_decoded.get(k) is not False:
            rows = self._chunk_rows[k][g]
            misses = self._io.get("cache_misses", 0)
            keep = None if self.cache is None else (lambda: self._keeps_decoded(k))
            try:
                table = cache.get(
                    self._cache_key(k, g), rows, lambda: self._fit(k, g, handle), keep
                )
            except _TooLarge as large:  # decoded here, kept in this process only
                table = large.table
            if self._io.get("cache_misses", 0) == misses:  # mapped: decoded by another
                self._count(cache_hits=1)
                if self.cache is not None:  # as read: no longer pinned as ahead
                    self.cache.seen(*self._remote(k))
            elif self.cache is not None and self._keep_decoded.get(k):  # written here:
                self._retire_if_decoded(k)  # the shard may be done with
            # mapped (no heap), unless the shard is not kept decoded (then decoded here)
            size = 0 if self._keep_decoded.get(k) is not False else _bytes(table)
        else:
            table = self._decode(k, g, handle)
            size = _bytes(table)
        self._groups[key] = (table, size)
        self._group_bytes += size
        self._evict()
        return table

    def _keeps_decoded(self, k: int) -> bool:
        """Whether remote shard ``k``'s row groups are kept decoded in the shard cache
        (its download dropped once they all are): when its selected columns are stored
        uncompressed, or nearly (their decoded size at most :data:`KEEP_DECODED_RATIO`
        times their bytes in the file, by its footer), so the one copy on disk is about
        the shard's size; else (compressed data) each process decodes what it reads
        from the downloaded shard, as with ``decoded_cache_bytes=0``.  The same answer
        in every process (the footer's), asked once per process and shard."""
        known = self._keep_decoded.get(k)
        if known is None:
            try:  # opened first: retired by another process after this, it stays the shard
                opened = open(self.local_path(k), "rb")  # noqa: SIM115  # closed below
            except FileNotFoundError:  # evicted just now
                opened = open(_Deferred(self, k).path(), "rb")  # noqa: SIM115
            with opened:
                if os.fstat(opened.fileno()).st_size == 0 and self._remote(k)[2]:
                    self._keep_decoded[k] = True  # retired: kept decoded, by another
                    return True
                meta = pq.ParquetFile(opened).metadata
            wanted = None if self.columns is None else set(self.columns)
            stored = decoded = 0
            per_group = self._stored[k] = []
            for g in range(meta.num_row_groups):
                group = meta.row_group(g)
                per_group.append(0)
                for c in range(group.num_columns):
                    column = group.column(c)
                    if wanted is None or column.path_in_schema.split(".")[0] in wanted:
                        per_group[-1] += column.total_compressed_size
                        decoded += column.total_uncompressed_size
                stored += per_group[-1]
            known = self._keep_decoded[k] = decoded <= KEEP_DECODED_RATIO * stored
            if known and self.cache is not None:  # counted in the cache's look-ahead
                self.cache.decoding(*self._remote(k)[:2], decoded)
        return known

    def _fit(self, k: int, g: int, handle: Any) -> pa.Table:
        """Row group ``g`` of remote shard ``k`` decoded for the shard cache; raises
        :class:`_TooLarge` (nothing written) where it takes more than
        :data:`KEEP_DECODED_RATIO` times its stored bytes (and the slack): the footer's
        sizes are the encoded ones, and a dictionary-encoded column (a value repeated)
        decodes to many times them, a copy the look-ahead never counted.  The shard is
        then decoded by each process that reads it, as compressed Parquet is."""
        table = self._decode(k, g, handle)
        stored = self._stored.get(k)
        if self.cache is None or stored is None:  # local, or retired (its rows vetted)
            return table
        if _bytes(table) <= KEEP_DECODED_RATIO * stored[g] + KEEP_DECODED_SLACK:
            return table
        self._keep_decoded[k] = False
        self.cache.decoding(*self._remote(k)[:2], 0)  # the look-ahead counts the shard only
        logging.getLogger("evenly").info(
            "evenly: %s row group %d decodes to %d bytes, %.1fx its %d stored: kept as "
            "downloaded, decoded by each worker that reads it",
            self.urls[k],
            g,
            _bytes(table),
            _bytes(table) / max(1, stored[g]),
            stored[g],
        )
        raise _TooLarge(table)

    def _retire_if_decoded(self, k: int) -> None:
        """Drop remote shard ``k``'s cached copy once every row group of it is in the
        decoded-row cache (checked by the process that decoded one: the last one to
        finish sees them all): the one copy on disk is then the decoded one."""
        cache, store = self.decoded_cache, self.cache
        if cache is None or store is None:
            return
        for g in range(len(self._chunk_rows[k])):
            if not os.path.exists(cache.path_for(self._cache_key(k, g))):
                return
        store.retire(*self._remote(k))

    def _hit(self, key: tuple[int, int]) -> None:
        """A row group found in the process's LRU: the newest entry now, a cache hit,
        and (every ``_TOUCH_EVERY`` seconds) a refresh of its node cache entry's recency."""
        self._groups.move_to_end(key)
        io = self._io
        io["cache_hits"] = io.get("cache_hits", 0) + 1
        cache = self.decoded_cache
        if cache is not None:
            now = time.monotonic()
            if now >= self._touch_due.get(key, 0.0):
                self._touch_due[key] = now + _TOUCH_EVERY
                cache.used(self._cache_key(*key))

    def _cache_key(self, k: int, g: int) -> tuple[str, str, int, list[str] | None]:
        return self.urls[k], self._fingerprints[k], g, self.columns

    def _decode(self, k: int, g: int, handle: Any) -> pa.Table:
        """Decode row group ``g`` of shard ``k``, checking it is the one the manifest
        describes (and, before it goes into the node's cache under the shard's
        fingerprint, that the local file is still the one opened)."""
        # one thread: the workers (and ranks) are the parallelism, and Arrow's pool
        # threads would each keep an arena of freed memory
        started, waited = time.perf_counter(), self._fetch_waited()
        table: pa.Table = handle.read_row_group(g, columns=self.columns, use_threads=False)
        # a deferred handle downloads the shard first: that wait is fetch, not decode
        decoded = time.perf_counter() - started - (self._fetch_waited() - waited)
        self._count(
            cache_misses=1, bytes_decoded=int(table.get_total_buffer_size()), decode_seconds=decoded
        )
        expected = self._chunk_rows[k][g]
        changed = table.num_rows != expected
        if not changed and self.cache is None:  # each decode opens the file as it is now
            changed = local_fingerprint(self.urls[k]) != self._fingerprints[k]
        if changed:
            raise ValueError(
                f"row group {g} has {table.num_rows} rows, the manifest says {expected}: the "
                f"file changed since it was opened"
                if table.num_rows != expected
                else f"the file changed since it was opened (row group {g}); open the source again"
            )
        return table

    def _evict(self) -> None:
        while len(self._groups) > 1 and (
            self._group_bytes > self.row_group_cache_bytes or len(self._groups) > MAX_GROUPS
        ):
            self._drop(next(iter(self._groups)))

    def _drop(self, key: tuple[int, int]) -> None:
        """Row group ``key`` out of the LRU, with its accessors and views."""
        _, size = self._groups.pop(key)
        self._group_bytes -= size
        self._group_access.pop(key, None)
        self._group_views.pop(key, None)
        self._touch_due.pop(key, None)
        if size:  # a decoded table (mapped: no heap)
            _release_unused()

    def _chunk_views(self, k: int, g: int, handle: Any) -> list[npt.NDArray[Any]] | None:
        """A row group's column views, kept with its table (they hold no other memory;
        ``_chunk`` has just made the row group the newest entry of the LRU)."""
        key = (k, g)
        table = self._chunk(k, g, handle)
        if key not in self._group_views:
            self._group_views[key] = chunk_views(table)
        return self._group_views[key]

    def _row_access(self, k: int, g: int, handle: Any) -> RowAccess | None:
        """A row group's per-row accessors, kept and counted with its table."""
        key = (k, g)
        kept = self._group_access.get(key)
        if kept is not None:  # the row group is in the LRU (evicted with its accessors)
            self._hit(key)
            return kept
        table = self._chunk(k, g, handle)
        if key in self._group_access:
            return self._group_access[key]
        access = RowAccess.of(table)
        extra = access.nbytes if access is not None else 0
        self._groups[key] = (table, self._groups[key][1] + extra)
        self._group_bytes += extra
        self._group_access[key] = access
        self._evict()  # never the newest entry: this one
        return access

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.update(
            _groups=OrderedDict(),
            _group_bytes=0,
            _group_access={},
            _group_views={},
            _touch_due={},
            _pending={},
            _keep_decoded={},
        )
        return state


class VerifiedParquetFile(pq.ParquetFile):  # type: ignore[misc]  # pyarrow: untyped
    """A Parquet file whose pages are checked against their CRC-32 checksums when they
    are read (files written without checksums are read unverified: there is nothing to
    check them against); a page that fails raises naming the file and the row group.

    >>> import os, tempfile, pyarrow as pa, pyarrow.parquet as pq
    >>> path = os.path.join(tempfile.mkdtemp(), "a.parquet")
    >>> pq.write_table(pa.table({"x": [7, 8]}), path, write_page_checksum=True)
    >>> VerifiedParquetFile(path).read_row_group(0)["x"].to_pylist()
    [7, 8]
    """

    def __init__(self, path: str, url: str | None = None, memory_map: bool = False) -> None:
        super().__init__(path, page_checksum_verification=True, memory_map=memory_map)
        self.url = url or path

    def read_row_group(self, i: int, *args: Any, **kwargs: Any) -> pa.Table:
        try:
            table: pa.Table = super().read_row_group(i, *args, **kwargs)
        except OSError as exc:
            if "checksum" not in str(exc).lower():
                raise
            raise ValueError(
                f"row group {i} of {self.url} fails its page checksum ({exc}): the file is "
                f"damaged (bytes changed on disk or in a copy); restore it from a good copy, "
                f"or write it again"
            ) from exc
        return table


class _Deferred:
    """A shard opened only to decode a row group, and closed right after: a row group is
    decoded once per node (decoded-row cache) or per process (its LRU), and an open
    ``ParquetFile`` keeps about a column chunk of heap after a read."""

    __slots__ = ("k", "src")

    def __init__(self, src: ParquetSource, k: int) -> None:
        self.src, self.k = src, k

    def path(self) -> str:
        """The shard's local path: itself, or its copy in the cache (downloaded first,
        again if it was retired or evicted)."""
        path = self.src.local_path(self.k)
        cache = self.src.cache
        if cache is not None and cache.retired(path, self.src._remote(self.k)[2]):
            # its rows were decoded, and an entry of them is gone (evicted, or damaged)
            cache.restore(path)
            path = self.src.local_path(self.k)
        if not os.path.exists(path) and cache is not None:
            path = self.src.local_path(self.k)  # evicted by another process just now
        if not os.path.exists(path):
            raise FileNotFoundError(f"shard not found: {self.src.urls[self.k]}")
        return path

    def read_row_group(self, g: int, **kwargs: Any) -> pa.Table:
        path = self.path()
        # a cached remote shard is mapped, not read into a buffer (page cache, not heap)
        remote = self.src.cache is not None
        with VerifiedParquetFile(path, self.src.urls[self.k], memory_map=remote) as handle:
            table: pa.Table = handle.read_row_group(g, **kwargs)
        return table


class _TooLarge(Exception):
    """A decoded row group too large to keep in the shard cache, carried out of the
    cache's write with the table (see :meth:`ParquetSource._fit`)."""

    def __init__(self, table: pa.Table) -> None:
        super().__init__("decoded row group too large to keep")
        self.table = table


def _bytes(table: pa.Table) -> int:
    """The memory of a decoded table's buffers."""
    return int(table.get_total_buffer_size())


def _release_unused() -> None:
    """Hand the memory Arrow's pool holds free back to the OS when a decoded row group is
    dropped (its default allocator, mimalloc, keeps freed pages: a worker that has left a
    window keeps none of it).  Not after each decode: its scratch (about twice the row
    group) would then be faulted in again by the next decode, a decode-bound epoch
    (warm cache) at half speed on bench_remote's workload, for ~40 MiB per worker."""
    pa.default_memory_pool().release_unused()


def _node_cache(cache_dir: str | None, value: int | None) -> RowCache | None:
    """The decoded-row cache for these settings (None: off), with a warning when
    ``cache_dir`` is on a network file system (off there unless asked for by size)."""
    bound = _decoded_cache_bytes(value)
    if not bound:
        return None
    try:
        cache = RowCache(cache_dir, bound)
        why = unwritable(cache.dir)
    except CacheDirError as exc:
        why = exc.why
    if why is not None:
        warnings.warn(
            f"evenly.from_parquet: the decoded-row cache is off: {why}; the data is read "
            f"without it (correct, slower). To use it, {where_from(cache_dir)}; "
            f"decoded_cache_bytes=0 silences this",
            EvenlyWarning,
            stacklevel=4,
        )
        return None
    kind = network_fs(cache.dir)
    if kind is not None:
        used = value is not None
        warnings.warn(
            f"evenly.from_parquet: the decoded-row cache {cache.dir} is on a network file "
            f"system ({kind}): memory maps of it are slow and its locks unreliable; "
            + ("it is used, as decoded_cache_bytes asks; " if used else "it is off; ")
            + "point cache_dir (or $EVENLY_CACHE_DIR) at a local disk, or pass "
            "decoded_cache_bytes=0 to silence this",
            EvenlyWarning,
            stacklevel=4,
        )
        return cache if used else None
    return cache


def from_parquet(
    paths: Paths,
    *,
    columns: Sequence[str] | None = None,
    storage_options: dict[str, Any] | None = None,
    cache_dir: str | None = None,
    cache_bytes: int | None = None,
    max_in_flight: int | None = None,
    row_group_cache_bytes: int = DEFAULT_ROW_GROUP_CACHE,
    decoded_cache_bytes: int | None = None,
    use_manifest: bool = True,
) -> ParquetSource:
    """A source over Parquet shards: a list, a glob, a directory or an fsspec URL.

    Random access reads only the row group holding a sample.  Each row group of a local
    shard is decoded once per node into the decoded-row cache (Arrow IPC files in
    ``<cache_dir>/rows``, memory-mapped by every worker and rank on the node, at most
    ``decoded_cache_bytes`` in all: default ``$EVENLY_DECODED_CACHE_BYTES``, else 16 GiB;
    ``0`` turns it off, and it is off with a warning when ``cache_dir`` is on a network file
    system).  With it off, decoded row groups are kept as Arrow tables in a per-process
    LRU of ``row_group_cache_bytes``, each only until the reads the loader announced
    (:meth:`ParquetSource.prefetch`) have read its rows.  ``shuffle=True`` means a global
    shuffle for local shards whatever their size (so the order never depends on the cache
    setting) and a block shuffle for remote ones.  Remote shards are downloaded into a
    bounded local cache (``cache_dir``, ``cache_bytes``) before reading, with at most
    ``max_in_flight`` requests in flight per node (default ``$EVENLY_MAX_IN_FLIGHT``, else
    16); their row groups are decoded once per node into that cache, and a shard's
    download is dropped once all its row groups are: one copy per shard, ``cache_bytes``
    bounding all evenly writes (``decoded_cache_bytes=0``: no decoded copy, each process
    decodes what it reads).

    >>> import evenly
    >>> ds = evenly.Dataset(from_parquet("data/*.parquet"), shuffle=True)  # doctest: +SKIP
    """
    return ParquetSource(
        paths,
        columns=columns,
        storage_options=storage_options,
        cache_dir=cache_dir,
        cache_bytes=cache_bytes,
        max_in_flight=max_in_flight,
        row_group_cache_bytes=row_group_cache_bytes,
        decoded_cache_bytes=decoded_cache_bytes,
        use_manifest=use_manifest,
    )
