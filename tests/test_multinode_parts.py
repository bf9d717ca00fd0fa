"""A ``cache_dir`` shared by several nodes: a write in progress on another node is never
taken for an abandoned one.  Its ``.part-`` file names the writer's pid, which means
nothing on this host (that pid may be free here, or another process), and its entry's
lock may not reach this host (locks on shared file systems often do not): so this node's
eviction leaves it alone until it has been untouched for an hour, and only then removes
it.  Checked for the decoded-row cache and the shard cache, with the ``.part-`` name the
other node's writer gives it (:func:`evenly.sources._cachedir.part_path` there)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from evenly.sources._cache import ShardCache
from evenly.sources._cachedir import STALE_PART_SECONDS, host_tag, part_path
from evenly.sources._rowcache import RowCache

OTHER_HOST = "node-b~4026531836"


def dead_pid() -> int:
    """A pid no process of this host has any more."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def other_nodes_part(target: str) -> Path:
    """The ``.part-`` file a writer on node-b, whose pid is free here, has open."""
    part = Path(f"{target}.part-{dead_pid()}-{OTHER_HOST}-0123abcd")
    part.write_bytes(b"x" * 100)
    return part


def make_stale(part: Path) -> None:
    old = time.time() - STALE_PART_SECONDS - 60
    os.utime(part, (old, old))


def test_part_names_carry_the_writers_pid_and_host() -> None:
    assert host_tag() != OTHER_HOST
    name = os.path.basename(part_path("/cache/rows/abc.arrow"))
    head, _, tail = name.partition(".part-")
    pid, rest = tail.split("-", 1)
    assert head == "abc.arrow" and int(pid) == os.getpid()
    assert rest.rsplit("-", 1)[0] == host_tag()


def test_another_nodes_row_cache_write_is_left_alone_until_stale(tmp_path: Path) -> None:
    cache = RowCache(str(tmp_path), max_bytes=10)
    part = other_nodes_part(os.path.join(cache.dir, "0" * 32 + ".arrow"))
    # counted against the bound, never removed while the other node may still write it
    assert cache.evict() == 100 and part.exists()
    make_stale(part)
    assert cache.evict() == 0 and not part.exists()


def test_another_nodes_download_is_left_alone_until_stale(tmp_path: Path) -> None:
    cache = ShardCache(str(tmp_path), max_bytes=10)
    os.makedirs(cache.cache_dir)
    # its lock is free here: the other node's lock does not reach this one
    part = other_nodes_part(cache.path_for("s3://bucket/shard.tar", "fp"))
    assert cache.usage() == 100
    assert cache.evict() == [] and part.exists()
    make_stale(part)
    assert cache.evict() == [str(part)] and cache.usage() == 0
