"""The one byte-bounded LRU directory (:class:`evenly.sources._lrudir.LruDir`) under the
shard cache and the decoded-row cache: what counts, the order and depth of an eviction,
the keep set, the ledger, abandoned parts; real files in a tmp dir, real processes."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
from filelock import FileLock

from evenly.sources._cache import ShardCache
from evenly.sources._cachedir import cache_subdir, host_tag, publish
from evenly.sources._lrudir import EVICT_LOCK, LEDGER, LruDir
from tests.test_multinode_parts import dead_pid, make_stale, other_nodes_part


def entry(lru: LruDir, name: str, size: int = 100, mtime: float | None = None) -> str:
    path = os.path.join(lru.dir, name)
    Path(path).write_bytes(b"x" * size)
    if mtime is not None:
        os.utime(path, (mtime, mtime))
    return path


def test_only_entries_and_their_parts_count(tmp_path: Path) -> None:
    lru = LruDir(str(tmp_path), max_bytes=1 << 20, suffix=".bin")
    entry(lru, "a.bin")
    entry(lru, f"a.bin.part-{os.getpid()}-0123abcd", 30)  # a write in progress
    for other in ("a.bin.lock", EVICT_LOCK, LEDGER, "notes.txt"):
        entry(lru, other, 1000)
    assert lru.usage() == 130
    assert [os.path.basename(f.path) for f in lru.files(parts=False)] == ["a.bin"]
    assert LruDir(str(tmp_path / "missing"), 10).usage() == 0


def test_eviction_is_least_recently_used_first_down_to_the_low_water_mark(
    tmp_path: Path,
) -> None:
    lru = LruDir(str(tmp_path), max_bytes=300, suffix=".bin", low_water=0.7)
    paths = [entry(lru, f"{k}.bin", mtime=1000 + k) for k in range(3)]
    assert lru.evict() == ([], 300)  # at the bound: nothing goes, whatever the low water
    paths += [entry(lru, f"{k}.bin", mtime=1000 + k) for k in range(3, 5)]
    # 500 bytes: down to 70% of 300, oldest first, never the kept one (the oldest)
    assert lru.evict(keep={paths[0]}) == (paths[1:4], 200)
    assert sorted(os.listdir(tmp_path)) == [EVICT_LOCK, "0.bin", "4.bin"]


def test_at_low_water_one_eviction_goes_down_to_the_bound_only(tmp_path: Path) -> None:
    lru = LruDir(str(tmp_path), max_bytes=250)
    paths = [entry(lru, f"s{k}", mtime=1000 + k) for k in range(4)]
    assert lru.evict() == (paths[:2], 200)


def test_an_evicted_entrys_lock_goes_with_it_when_asked(tmp_path: Path) -> None:
    for drop in (False, True):
        folder = tmp_path / str(drop)
        folder.mkdir()
        lru = LruDir(str(folder), max_bytes=100, suffix=".bin", drop_locks=drop)
        old = entry(lru, "old.bin", mtime=1000)
        entry(lru, "new.bin", mtime=2000)
        Path(old + ".lock").touch()
        assert lru.evict()[0] == [old]
        assert os.path.exists(old + ".lock") is not drop


def test_the_ledger_counts_additions_without_a_scan_and_rescans_every_n(
    tmp_path: Path,
) -> None:
    lru = LruDir(str(tmp_path), max_bytes=1000, suffix=".bin", ledger=True, rescan_every=4)
    entry(lru, "a.bin", mtime=1000)
    assert lru.added(100) == 100  # no ledger yet: a scan
    entry(lru, "unaccounted.bin", 300, mtime=2000)  # written behind the ledger's back
    # trusted for 3 additions (the 300 bytes unseen), then the 4th scans
    assert [lru.added(10) for _ in range(4)] == [110, 120, 130, 400]
    assert (tmp_path / LEDGER).read_text() == "400 0"
    (tmp_path / LEDGER).write_text("damaged")
    assert lru.added(10) == 400  # a damaged ledger: a scan
    # past the bound: an eviction down to the bound (low water 1.0), oldest first but
    # never the new entry (the oldest by mtime, kept)
    new = entry(lru, "new.bin", 700, mtime=500)
    assert lru.added(700, keep=[new]) == 1000
    assert sorted(os.listdir(tmp_path)) == [EVICT_LOCK, LEDGER, "new.bin", "unaccounted.bin"]
    with pytest.raises(ValueError, match="ledger=True"):
        LruDir(str(tmp_path), 10).added(1)


def test_bad_settings_are_refused_naming_them(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="max_bytes >= 1, got 0"):
        LruDir(str(tmp_path), 0)
    with pytest.raises(ValueError, match=r"low_water .* got 1.5"):
        LruDir(str(tmp_path), 10, low_water=1.5)
    with pytest.raises(ValueError, match="rescan_every must be >= 1, got 0"):
        LruDir(str(tmp_path), 10, rescan_every=0)


def test_abandoned_parts_are_removed_and_running_ones_counted(tmp_path: Path) -> None:
    lru = LruDir(str(tmp_path), max_bytes=10, suffix=".bin")
    running = entry(lru, f"a.bin.part-{os.getpid()}-0123abcd")
    dead = entry(lru, f"b.bin.part-{dead_pid()}-0123abcd")
    with FileLock(os.path.join(lru.dir, "a.bin.lock")):  # a's writer holds its lock
        assert lru.remove_abandoned() == [dead]
        assert lru.evict() == ([], 100) and os.path.exists(running)
    assert lru.evict() == ([running], 0)  # its lock is free now: nobody writes it
    assert pickle.loads(pickle.dumps(lru)).__dict__ == lru.__dict__


def test_a_killed_downloads_part_goes_while_another_process_downloads_the_shard(
    tmp_path: Path,
) -> None:
    """The shard cache's abandoned parts are the row cache's: a part whose writer is
    dead is removed even while a new download of the same shard holds its lock (it
    counted against the bound until that download ended)."""
    cache = ShardCache(str(tmp_path), max_bytes=10)
    os.makedirs(cache.cache_dir)
    target = cache.path_for("s3://bucket/shard.tar", "fp")
    killed = f"{target}.part-{dead_pid()}-0123abcd"
    running = f"{target}.part-{os.getpid()}-4567cdef"
    Path(killed).write_bytes(b"x" * 100)
    Path(running).write_bytes(b"y" * 50)
    with FileLock(target + ".lock"):  # held by the running download
        assert cache.evict() == [killed] and cache.usage() == 50
    assert os.path.exists(running)


def test_a_killed_writers_part_goes_when_the_file_is_next_published(tmp_path: Path) -> None:
    """Publish-once files (packing's lengths and plans, token-mix plans) have no bound
    and no eviction: the part a killed writer left is removed by the next process that
    writes the same file, not left on disk for ever; another node's, only once stale."""
    target = os.path.join(cache_subdir("lengths", str(tmp_path)), "abc.i32")
    killed = Path(f"{target}.part-{dead_pid()}-{host_tag()}-0123abcd")
    killed.write_bytes(b"x" * 100)
    elsewhere = other_nodes_part(target)
    publish(target, lambda tmp: Path(tmp).write_bytes(b"lengths"))
    assert Path(target).read_bytes() == b"lengths"
    assert not killed.exists() and elsewhere.exists()
    make_stale(elsewhere)
    os.unlink(target)
    publish(target, lambda tmp: Path(tmp).write_bytes(b"again"))
    assert sorted(os.listdir(os.path.dirname(target))) == ["abc.i32", "abc.i32.lock"]
