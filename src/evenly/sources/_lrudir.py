"""A directory of cache entries bounded in bytes, shared by every process on the node:
the one eviction under the shard cache (:mod:`evenly.sources._cache`) and the
decoded-row cache (:mod:`evenly.sources._rowcache`).

- Entries are written through a ``.part-`` file renamed into place (by
  :func:`evenly.sources._cachedir.publish`, or the shard download) while the writer
  holds the entry's lock (``<entry>.lock``); parts count against the bound.
- A part whose writer is gone (:func:`~evenly.sources._cachedir.part_abandoned`: its
  process is dead or its entry's lock is free; another host's, only once stale) is
  removed by the next eviction: a killed writer leaves nothing behind for long.
- Eviction runs under one lock per directory (``.evict.lock``): once the directory holds
  more than ``max_bytes``, entries go least-recently-used first (by mtime, which readers
  refresh) until at most ``low_water`` of the bound is left, never one in ``keep`` (nor
  an empty one: it frees nothing, and may mark something, see ``ShardCache.retire``).  A
  process that still has an evicted file open keeps reading it (POSIX).
- With ``ledger``, the running total is kept in a small file (``.usage``) so that
  :meth:`LruDir.added` costs one lock, not a directory scan; the directory is scanned
  when the ledger says the bound is passed, and every ``rescan_every`` additions.

>>> import os, tempfile
>>> lru = LruDir(tempfile.mkdtemp(), max_bytes=150, suffix=".bin")
>>> for k in range(3):
...     path = os.path.join(lru.dir, f"{k}.bin")
...     with open(path, "wb") as f:
...         _ = f.write(b"x" * 100)
...     os.utime(path, (1000 + k, 1000 + k))
>>> removed, left = lru.evict(keep=[os.path.join(lru.dir, "0.bin")])
>>> [os.path.basename(p) for p in removed], left, lru.usage()
(['1.bin', '2.bin'], 100, 100)
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Collection
from typing import NamedTuple

from filelock import FileLock, Timeout

from ._cachedir import LOCK_POLL, PART, part_abandoned

__all__ = ["EVICT_LOCK", "LEDGER", "CacheFile", "LruDir"]

#: the directory's eviction lock
EVICT_LOCK = ".evict.lock"
#: the ledger: ``<bytes> <additions since the last scan>``
LEDGER = ".usage"
_LOCK = ".lock"


class CacheFile(NamedTuple):
    """A file of the directory, as eviction orders them (least recently used first)."""

    mtime: float
    path: str
    size: int


class LruDir:
    """The files of ``directory`` kept to at most ``max_bytes`` (see the module
    docstring).  Picklable: plain settings, no handle kept.

    Args:
        directory: where the entries live (created by the first eviction if needed).
        max_bytes: the bound (entries and parts together).
        suffix: what an entry's name ends with (``""``: any name but locks and the
            ledger); its parts are named ``<entry>.part-...``.
        low_water: the share of ``max_bytes`` an eviction leaves, once it has to evict.
        ledger: keep the running total in :data:`LEDGER` (see :meth:`added`).
        rescan_every: additions between two scans of the directory, with ``ledger``.
        drop_locks: remove an evicted entry's lock file with it.
    """

    def __init__(
        self,
        directory: str,
        max_bytes: int,
        *,
        suffix: str = "",
        low_water: float = 1.0,
        ledger: bool = False,
        rescan_every: int = 64,
        drop_locks: bool = False,
    ) -> None:
        if max_bytes < 1:
            raise ValueError(f"a bounded cache directory needs max_bytes >= 1, got {max_bytes}")
        if not 0.0 < low_water <= 1.0:
            raise ValueError(f"low_water is a share of max_bytes in (0, 1], got {low_water}")
        if rescan_every < 1:
            raise ValueError(f"rescan_every must be >= 1, got {rescan_every}")
        self.dir = directory
        self.max_bytes = int(max_bytes)
        self.suffix = suffix
        self.low_water = float(low_water)
        self.ledger = ledger
        self.rescan_every = int(rescan_every)
        self.drop_locks = drop_locks

    # ---- what is there -------------------------------------------------------------
    def is_part(self, name: str) -> bool:
        """Whether the file name ``name`` is an entry being (or left half) written."""
        return self.suffix + PART in name

    def files(self, parts: bool = True) -> list[CacheFile]:
        """The entries (and, with ``parts``, the parts) in the directory."""
        out = []
        try:
            with os.scandir(self.dir) as it:
                for e in it:
                    name = e.name
                    if name.endswith(_LOCK) or name == LEDGER:
                        continue
                    if self.is_part(name):
                        if not parts:
                            continue
                    elif not name.endswith(self.suffix):
                        continue
                    with contextlib.suppress(FileNotFoundError):
                        st = e.stat()
                        out.append(CacheFile(st.st_mtime, e.path, st.st_size))
        except FileNotFoundError:
            return []
        return out

    def usage(self) -> int:
        """Bytes in the directory: entries and parts (being written, or abandoned)."""
        return sum(f.size for f in self.files())

    # ---- abandoned parts -----------------------------------------------------------
    def abandoned(self, part: str) -> bool:
        """Whether the writer of ``part`` is gone (:func:`part_abandoned`, with its
        entry's lock as the lock)."""
        head = os.path.basename(part).partition(PART)[0]
        lock = os.path.join(os.path.dirname(part), head + _LOCK)
        return part_abandoned(part, lambda: _lock_free(lock))

    def remove_abandoned(self) -> list[str]:
        """Remove the parts whose writer is gone; the paths removed."""
        removed = []
        for f in self.files():
            if self.is_part(os.path.basename(f.path)) and self.abandoned(f.path):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(f.path)
                    removed.append(f.path)
        return removed

    # ---- eviction ------------------------------------------------------------------
    def evict(self, keep: Collection[str] = ()) -> tuple[list[str], int]:
        """Remove abandoned parts, then, if more than ``max_bytes`` remain, entries least
        recently used first down to ``low_water`` of it, never those in ``keep``.
        Returns the paths removed and the bytes left (the ledger is set to them)."""
        os.makedirs(self.dir, exist_ok=True)
        with FileLock(os.path.join(self.dir, EVICT_LOCK)).acquire(poll_interval=LOCK_POLL):
            removed, total = self._evict_locked(keep)
            if self.ledger:
                self._write_ledger(total, 0)
        return removed, total

    def added(self, size: int, keep: Collection[str] = ()) -> int:
        """Count a new entry of ``size`` bytes in the ledger; evict (as :meth:`evict`)
        when the total passes the bound, or when the ledger is missing, damaged or due
        for a scan.  Returns the bytes the ledger now holds."""
        if not self.ledger:
            raise ValueError("LruDir.added needs ledger=True: without one, call evict()")
        os.makedirs(self.dir, exist_ok=True)
        with FileLock(os.path.join(self.dir, EVICT_LOCK)).acquire(poll_interval=LOCK_POLL):
            try:
                with open(os.path.join(self.dir, LEDGER), encoding="ascii") as f:
                    total, writes = (int(x) for x in f.read().split())
            except (OSError, ValueError):
                total, writes = -1, self.rescan_every  # none yet, or damaged: scan
            if total < 0 or total + size > self.max_bytes or writes + 1 >= self.rescan_every:
                total, writes = self._evict_locked(keep)[1], 0
            else:
                total, writes = total + size, writes + 1
            self._write_ledger(total, writes)
        return total

    def _evict_locked(self, keep: Collection[str]) -> tuple[list[str], int]:
        """:meth:`evict`, its lock held."""
        removed: list[str] = []
        entries = []
        total = 0
        for f in self.files():
            if self.is_part(os.path.basename(f.path)):
                if self.abandoned(f.path):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(f.path)
                        removed.append(f.path)
                    continue
            else:
                entries.append(f)
            total += f.size
        if total <= self.max_bytes:
            return removed, total
        goal = int(self.max_bytes * self.low_water)
        for _, path, size in sorted(entries):
            if total <= goal:
                break
            if not size or path in keep:  # an empty file frees nothing
                continue
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
                removed.append(path)
            if self.drop_locks:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path + _LOCK)
            total -= size
        return removed, total

    def _write_ledger(self, total: int, writes: int) -> None:
        """Best effort: a ledger that cannot be written is rebuilt by the next scan."""
        with (
            contextlib.suppress(OSError),
            open(os.path.join(self.dir, LEDGER), "w", encoding="ascii") as f,
        ):
            f.write(f"{total} {writes}")


def _lock_free(path: str) -> bool:
    """Whether the lock file ``path`` can be taken now (by no process of this host)."""
    lock = FileLock(path)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        return False
    lock.release()
    return True
