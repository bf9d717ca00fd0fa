"""A ``cache_dir`` shared by several nodes: a write in progress on another node is never
taken for an abandoned one.  Its ``.part-`` file names the writer's pid, which means
nothing on this host (that pid may be free here, or another process), and its entry's
lock may not reach this host (locks on shared file systems often do not): so this node's
eviction leaves it alone until it has been untouched for an hour, and only then removes
it.  Checked for the decoded-row cache and the shard cache, with the ``.part-`` name the
other node's writer gives it (:func:`evenly.sources._cachedir.part_path` there), and
end to end for the row cache with a real writer on a simulated other node: a process in
its own UTS and PID namespaces (host name node-b, a pid that no process has here)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from evenly.sources._cache import ShardCache
from evenly.sources._cachedir import STALE_PART_SECONDS, host_tag, part_path
from evenly.sources._rowcache import RowCache
from tests.distributed import ROOT

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


#: the other node's writer: publishes ``target``, pausing mid-write until ``go`` exists
WRITER = """
import os, pathlib, sys, time
from evenly.sources._cachedir import publish
target, started, go = sys.argv[1:4]
def write(tmp):
    with open(tmp, "wb") as f:
        f.write(b"x" * 100)
        f.flush()
        pathlib.Path(started + ".tmp").write_text(tmp)
        os.replace(started + ".tmp", started)
        while not os.path.exists(go):
            time.sleep(0.01)
        f.write(b"y")
publish(target, write)
"""


def free_pid() -> int:
    """A pid that no process of this host has (for the other node's writer)."""
    with open("/proc/sys/kernel/pid_max") as f:
        top = min(int(f.read()), 1 << 22) - 10
    return next(p for p in range(top, 300, -1) if not os.path.exists(f"/proc/{p}"))


@pytest.mark.skipif(
    sys.platform != "linux" or os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="simulating another node needs root and unshare (Linux namespaces)",
)
def test_a_write_in_progress_on_another_node_survives_this_nodes_eviction(
    tmp_path: Path,
) -> None:
    cache = RowCache(str(tmp_path / "shared"), max_bytes=10)
    target = os.path.join(cache.dir, "1" * 32 + ".arrow")
    started, go = tmp_path / "started", tmp_path / "go"
    pid = free_pid()
    inner = 'hostname node-b && echo "$1" > /proc/sys/kernel/ns_last_pid && shift && "$@"'
    cmd = ["unshare", "-u", "-p", "-f", "--mount-proc", "sh", "-c", inner, "sh", str(pid - 1)]
    cmd += [sys.executable, "-c", WRITER, target, str(started), str(go)]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(ROOT)])),
    }
    writer = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not started.exists() and writer.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert started.exists(), "the other node's writer did not start"
        part = Path(started.read_text())
        assert f".part-{pid}-node-b~" in part.name and not os.path.exists(f"/proc/{pid}")
        # this node's eviction: the bound is passed, the other node's write is counted
        assert cache.evict() == 100 and part.exists()
    finally:
        go.touch()  # the other node finishes its write
        try:
            out = writer.communicate(timeout=60)[0].decode(errors="replace")
        finally:
            if writer.poll() is None:
                writer.kill()
                writer.communicate()
    assert writer.returncode == 0, out
    assert Path(target).read_bytes() == b"x" * 100 + b"y" and not part.exists()
