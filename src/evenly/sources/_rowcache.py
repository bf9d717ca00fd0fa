"""The node-local decoded-row cache: chunks (Parquet row groups) decoded once per node
into Arrow IPC files under ``<cache_dir>/rows``, memory-mapped by every process that
reads them (every DataLoader worker of every rank on the node shares one copy in the
page cache: file-backed, reclaimable memory instead of a private decode per process).

- An entry is named by a hash of (shard URL, shard fingerprint, chunk, columns), so a
  changed file (new size, mtime, ctime, inode or ETag) is decoded again, never served
  stale; the file also records that identity and its row count, and ends with a CRC-32
  of all its other bytes, both checked when it is mapped, so a damaged (a flipped bit)
  or foreign file is removed and decoded again, with an ``EvenlyWarning``, never served.
- It is written once per node through :func:`evenly.sources._cachedir.publish` (a
  ``.part-`` file renamed into place under the entry's lock): a killed writer leaves
  only a ``.part-`` file no reader opens, removed by the next eviction.
- The directory holds at most ``max_bytes`` (``$EVENLY_DECODED_CACHE_BYTES``, default
  16 GiB): after each write, entries are evicted least-recently-used first (by mtime,
  refreshed when a process maps an entry, and every 30 s while it keeps using it).  A
  process that has an evicted entry mapped keeps reading it (POSIX), so usage may
  exceed the bound by the entries in use, until they are unmapped.  The total is kept in
  a small ledger (``.usage``) so a write costs one lock, not a directory scan; the
  directory is scanned when the ledger says the bound is passed, and every 64 writes.
- For remote shards (``store``: the shard cache) the entries live in the shard cache's
  directory, named after their shard's cached copy (``<shard>@rg<chunk>-<hash>.arrow``),
  and the shard cache's eviction (after each download) bounds them with the shards,
  under ``cache_bytes``: one bound for everything evenly writes for remote data; the
  entries of a shard a live process pins are kept with it (:meth:`ShardCache.evict`).
  A shard's entries are written after its download and its copy dropped once they are
  all written; the look-ahead counts a shard with its entries
  (:meth:`ShardCache.decoding`) from its first decode: the bound may be passed by the
  entries of the shards being decoded that were downloaded ahead before it.

>>> import os, tempfile, pyarrow as pa
>>> cache = RowCache(tempfile.mkdtemp(), max_bytes=1 << 20)
>>> key = ("/data/a.parquet", "123:4:5:6", 0, None)
>>> t = cache.get(key, 3, lambda: pa.table({"x": [1, 2, 3]}))
>>> t["x"].to_pylist(), cache.misses, cache.get(key, 3, lambda: pa.table({})).num_rows
([1, 2, 3], 1, 3)
>>> cache.hits, cache.decodes
(1, 1)
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import struct
import time
import warnings
import zlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import pyarrow as pa
from filelock import FileLock

from evenly.errors import EvenlyWarning

from ._cachedir import ENTRY_MARK, CacheDirError, cache_subdir, publish, where_from
from ._lrudir import LruDir

if TYPE_CHECKING:
    from ._cache import ShardCache

__all__ = [
    "DEFAULT_DECODED_CACHE_BYTES",
    "ENTRY_MARK",
    "ENV_BYTES",
    "RowCache",
    "decoded_cache_bytes",
]

logger = logging.getLogger("evenly")

#: Default bound of the decoded-row cache on a node (bytes of Arrow IPC files).
DEFAULT_DECODED_CACHE_BYTES = 16 << 30
#: the environment variable that overrides the default bound (0: no cache)
ENV_BYTES = "EVENLY_DECODED_CACHE_BYTES"
_META = b"evenly.rows"
#: the entry layout, part of its name: 2 = an Arrow IPC file, then :data:`_TRAILER`
_LAYOUT = 2
#: what follows the Arrow IPC file: the CRC-32 of every byte before it, and a magic
_TRAILER = struct.Struct("<I8s")
_MAGIC = b"evenlyck"
_SUFFIX = ".arrow"
_RESCAN_EVERY = 64  # writes between full scans, whatever the ledger says
_TOUCH_EVERY = 30.0  # seconds between mtime refreshes of an entry a process keeps using
_LOW_WATER = 0.9  # an eviction leaves at most this share of the bound

#: a chunk's identity: (shard URL, shard fingerprint, chunk number, columns or None)
Key = tuple[str, str, int, Sequence[str] | None]


def decoded_cache_bytes(value: int | None) -> int:
    """The bound to use: ``value``, else ``$EVENLY_DECODED_CACHE_BYTES``, else the
    default; 0 turns the cache off.

    >>> decoded_cache_bytes(0), decoded_cache_bytes(5)
    (0, 5)
    """
    if value is None:
        raw = os.environ.get(ENV_BYTES, "")
        try:
            value = int(raw) if raw.strip() else DEFAULT_DECODED_CACHE_BYTES
        except ValueError:
            raise ValueError(
                f"${ENV_BYTES}={raw!r} is not a whole number of bytes (0 turns the "
                f"decoded-row cache off)"
            ) from None
    if value < 0:
        raise ValueError(
            f"decoded_cache_bytes must be >= 0 (0 turns the decoded-row cache off), got {value}"
        )
    return int(value)


class RowCache:
    """Decoded chunks shared by every process on the node (see the module docstring).

    Picklable; the counters are per process: ``hits`` (a chunk found decoded, by this
    process or another), ``misses`` (not found: decoded by this process, or by another
    while this one waited on its lock), ``decodes`` (decoded by this process).

    With ``store`` (remote shards), the entries are the shard cache's, bounded with its
    shards by its ``max_bytes`` (``max_bytes`` here is then ignored).
    """

    def __init__(
        self, cache_dir: str | None, max_bytes: int, store: ShardCache | None = None
    ) -> None:
        if max_bytes < 1:
            raise ValueError(f"the decoded-row cache needs max_bytes >= 1, got {max_bytes}")
        self.cache_dir = cache_dir
        self.store = store
        #: the setting that bounds the entries (named in warnings)
        self.setting = "cache_bytes" if store is not None else "decoded_cache_bytes"
        self._lru: LruDir | None = None
        if store is not None:
            self.dir = store.cache_dir
            self.max_bytes = store.max_bytes
        else:
            self.dir = cache_subdir("rows", cache_dir)
            self.max_bytes = int(max_bytes)
            #: the bound: ``*.arrow`` entries, evicted with their lock, down to 90%, a ledger
            self._lru = LruDir(
                self.dir,
                self.max_bytes,
                suffix=_SUFFIX,
                low_water=_LOW_WATER,
                ledger=True,
                rescan_every=_RESCAN_EVERY,
                drop_locks=True,
            )
        self.hits = self.misses = self.decodes = 0
        #: whether this process still writes entries (off after the directory refused one)
        self.writes = True
        self._touched: dict[str, float] = {}
        self._paths: dict[tuple[str, str, int, tuple[str, ...] | None], str] = {}

    def __getstate__(self) -> dict[str, Any]:
        fresh = {"hits": 0, "misses": 0, "decodes": 0, "_touched": {}, "_paths": {}}
        return {**self.__dict__, **fresh}

    def stats(self) -> dict[str, int]:
        """This process's counters (``hits``, ``misses``, ``decodes``)."""
        return {"hits": self.hits, "misses": self.misses, "decodes": self.decodes}

    def path_for(self, key: Key) -> str:
        """The entry's file (it may not exist)."""
        url, fingerprint, chunk, columns = key
        memo = (url, fingerprint, chunk, None if columns is None else tuple(columns))
        path = self._paths.get(memo)
        if path is None:
            name = _digest(key) + _SUFFIX
            if self.store is not None:  # beside its shard, named after it (see evict)
                shard = os.path.basename(self.store.path_for(url, fingerprint))
                name = f"{shard}{ENTRY_MARK}rg{int(chunk)}-{name[:16]}{_SUFFIX}"
            path = self._paths[memo] = os.path.join(self.dir, name)
        return path

    # ---- reading -------------------------------------------------------------------
    def get(
        self,
        key: Key,
        rows: int,
        decode: Callable[[], pa.Table],
        keep: Callable[[], bool] | None = None,
    ) -> pa.Table:
        """Chunk ``key`` (``rows`` rows) as an Arrow table memory-mapped from the cache,
        decoded with ``decode()`` and written first if no process has done it yet (and
        ``keep()``, asked only then, does not say no: then decoded, not written)."""
        path = self.path_for(key)
        table = self._load(path, key, rows)
        if table is not None:
            self.hits += 1
            return table
        self.misses += 1
        if keep is not None and not keep():
            return decode()
        for _ in range(2):  # once more if another process evicts it before we map it
            if not self.writes:
                return decode()
            try:
                made = self._publish(path, key, decode)
            except _DecodeError as exc:  # the shard's own error, as it is
                raise exc.error from None
            except CacheDirError as exc:  # full, read-only...: read without writing
                self.writes = False
                setting = (
                    self.setting if self.store is not None else f"{self.setting} (or ${ENV_BYTES})"
                )
                warnings.warn(
                    f"evenly.from_parquet: the decoded-row cache stops writing in this "
                    f"process: {exc.why}; the data is read without it (correct, slower). "
                    f"{setting} is {self.max_bytes >> 20} MiB: "
                    f"lower it below the free space, or {where_from(self.cache_dir)}; "
                    f"decoded_cache_bytes=0 silences this",
                    EvenlyWarning,
                    stacklevel=5,
                )
                return decode()
            except OSError as exc:
                logger.warning("evenly: cannot write the decoded-row cache %s: %s", self.dir, exc)
                return decode()
            if made is not None:
                return made
            table = self._load(path, key, rows)
            if table is not None:
                return table
        return decode()

    def _publish(self, path: str, key: Key, decode: Callable[[], pa.Table]) -> pa.Table | None:
        """Write the entry unless another process has; the table mapped if this one did."""
        made: list[pa.Table] = []

        def write(tmp: str) -> None:
            try:
                decoded = decode()
            except Exception as exc:
                raise _DecodeError(exc) from exc
            self.decodes += 1
            _write(tmp, decoded, key)
            del decoded
            pa.default_memory_pool().release_unused()  # the decode's memory, to the OS
            made.append(_map(tmp, verify=False))  # the same inode once renamed (or evicted)

        publish(path, write, self.cache_dir, sweep=False)  # the eviction sweeps
        if not made:
            return None
        with contextlib.suppress(FileNotFoundError):
            self._account(os.path.getsize(path), path)
        return made[0]

    def used(self, key: Key) -> None:
        """Refresh the entry's recency (for eviction) if it was not in the last 30 s:
        called by a process that keeps the mapped table and reads it again."""
        path = self.path_for(key)
        now = time.monotonic()
        if now - self._touched.get(path, 0.0) >= _TOUCH_EVERY:
            self._touched[path] = now
            with contextlib.suppress(OSError):
                os.utime(path)

    def _load(self, path: str, key: Key, rows: int) -> pa.Table | None:
        """The entry mapped, or None if it is missing (or cannot be read); one that is
        damaged or does not hold this chunk is removed, with a warning (and None)."""
        try:
            table = self._entry(path, key, rows)
        except FileNotFoundError:
            return None
        except _Damaged as damage:
            return self._drop(path, key, rows, damage)
        except OSError as exc:  # no permission...: this entry is decoded, not cached
            logger.warning("evenly: cannot read the decoded-row cache entry %s: %s", path, exc)
            return None
        self._touched[path] = time.monotonic()
        with contextlib.suppress(OSError):
            os.utime(path)
        return table

    def _entry(self, path: str, key: Key, rows: int) -> pa.Table:
        """The entry mapped, its checksum and the chunk it records checked; raises
        :class:`_Damaged` if they fail, ``OSError`` if it cannot be opened."""
        try:
            table = _map(path)
            found = table.schema.metadata or {}
        except (ValueError, pa.ArrowException) as exc:
            raise _Damaged(str(exc)) from exc
        if found.get(_META) != _identity(key, rows) or table.num_rows != rows:
            raise _Damaged("it records another chunk")
        return table

    def _drop(self, path: str, key: Key, rows: int, damage: _Damaged) -> pa.Table | None:
        """Remove the damaged entry at ``path``, with a warning, unless another process
        has replaced it meanwhile (checked under the entry's lock, so one process warns
        and every process then decodes or maps the new entry); the replacement if so."""
        try:
            with FileLock(path + ".lock"):
                try:
                    return self._entry(path, key, rows)
                except (OSError, _Damaged):
                    pass
                os.unlink(path)
        except OSError:  # gone meanwhile, or the directory cannot be written
            return None
        url, _, chunk, _ = key
        warnings.warn(
            f"evenly.from_parquet: the decoded-row cache entry {path} (row group {chunk} of "
            f"{url}) is damaged ({damage}): bytes changed on disk since it was written; it "
            f"is removed and the row group decoded again. If this repeats, check the disk "
            f"holding {self.dir}, or pass decoded_cache_bytes=0",
            EvenlyWarning,
            stacklevel=5,
        )
        return None

    # ---- the bound -----------------------------------------------------------------
    def usage(self) -> int:
        """Bytes in the cache: entries and writes (running or abandoned); with a
        ``store``, its shards too (one bound for both)."""
        if self.store is not None:
            return self.store.usage()
        return self._lru.usage() if self._lru is not None else 0

    def _account(self, added: int, keep: str) -> None:
        """Add a new entry to the ledger; evict if the bound is passed (or it is time
        for a scan).  With a ``store``, nothing: its eviction, after each download,
        bounds the entries with the shards (an entry is written after its shard was
        downloaded, and that shard is dropped once all its entries are written; an
        eviction here would take the row groups of a shard that another worker has not
        read yet, nor pinned: its look-ahead job still queued, it downloads it again)."""
        if self._lru is not None:
            self._lru.added(added, (keep,))

    def evict(self, keep: str | None = None) -> int:
        """Remove abandoned writes, then least-recently-used entries until the cache
        holds at most 90% of ``max_bytes`` (if it held more than ``max_bytes``).
        Returns the bytes left.  With a ``store``, its eviction (down to its bound)."""
        if self.store is not None:
            self.store.evict(keep=keep)
            return self.store.usage()
        if self._lru is None:
            return 0
        return self._lru.evict(() if keep is None else (keep,))[1]


class _Damaged(Exception):
    """An entry whose bytes are not what was written (checksum, layout or identity)."""


class _DecodeError(Exception):
    """The decode's own error, carried through the write (so it is not taken for a
    failure to write the cache)."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


def _digest(key: Key) -> str:
    return hashlib.sha256(_identity(key, -1)).hexdigest()[:32]


def _identity(key: Key, rows: int) -> bytes:
    url, fingerprint, chunk, columns = key
    cols = None if columns is None else list(columns)
    record = {"url": url, "fingerprint": fingerprint, "chunk": int(chunk), "columns": cols}
    record["layout"] = _LAYOUT
    if rows >= 0:
        record["rows"] = int(rows)
    return json.dumps(record, sort_keys=True).encode()


def _write(tmp: str, table: pa.Table, key: Key) -> None:
    """``table`` as one uncompressed Arrow IPC file (one record batch: zero-copy views of
    whole columns once mapped), recording the chunk it holds, then the CRC-32 of those
    bytes (read back: just written, they are in the page cache)."""
    meta = {_META: _identity(key, table.num_rows)}
    table = table.combine_chunks().replace_schema_metadata(meta)
    with pa.OSFile(tmp, "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=max(table.num_rows, 1))
    with open(tmp, "r+b") as f:
        crc = 0
        while chunk := f.read(_CRC_BLOCK):
            crc = zlib.crc32(chunk, crc)
        f.write(_TRAILER.pack(crc, _MAGIC))


#: bytes read at a time to checksum a new entry
_CRC_BLOCK = 8 << 20


def _map(path: str, *, verify: bool = True) -> pa.Table:
    """An entry as a table whose buffers live in a read-only memory map (no file
    descriptor kept: the map holds the file, even once it is renamed or removed); with
    ``verify``, its CRC-32 is checked first (``ValueError`` if it fails).

    Through Arrow's own map, closed once read: its buffers keep the mapping, not the
    file.  ``mmap.mmap`` would keep a duplicate of the descriptor for as long as the map
    lives (``trackfd`` exists from Python 3.13 only): a process holding many row groups
    would hold as many descriptors.  The cost: Arrow advises the kernel that the entry
    will be needed (``madvise(WILLNEED)``) as it maps it, so a first map in a process
    takes longer, with the entry's size: 0.65-1.1 ms for a 15 MiB entry against
    0.03-0.15 ms with ``mmap.mmap`` (warm page cache, a busy 2-core machine); once per
    entry and process, since the process's LRU keeps it mapped."""
    with pa.memory_map(path) as mapped:
        size = mapped.size()
        if size <= _TRAILER.size:
            raise ValueError(f"it is {size} bytes, too short for an entry")
        whole = mapped.read_buffer(size)  # a view of the map (no copy)
    body = size - _TRAILER.size
    crc, magic = _TRAILER.unpack_from(whole, body)
    if magic != _MAGIC:
        raise ValueError("it does not end with a checksum")
    if verify:
        found = zlib.crc32(whole.slice(0, body))
        if found != crc:
            raise ValueError(f"its CRC-32 is {found:08x}, {crc:08x} when it was written")
    reader = pa.ipc.open_file(whole.slice(0, body))
    batches = [reader.get_batch(i) for i in range(reader.num_record_batches)]
    return pa.Table.from_batches(batches, schema=reader.schema)
