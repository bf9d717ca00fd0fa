"""The one place node-local files live: ``cache_dir`` and its sub-directories.

Every file evenly keeps on a machine (remote shard copies, manifests, packing's lengths,
decoded rows) lives under one ``cache_dir`` (``$EVENLY_CACHE_DIR``, else
``~/.cache/evenly``), one sub-directory per kind, shared by every process of the user on
the node.  Files are written once, by whichever process comes first, through
:func:`publish`: a reader never sees a partial file, a killed writer leaves nothing a
reader trusts.

Several nodes may share one ``cache_dir`` (a shared file system): nothing here relies on
a lock reaching across nodes (a lock only saves a second node the same write), entries
are named by their content's identity and renamed into place whole, and a ``.part-``
file names its writer's host, so that no node ever takes another node's write in
progress for an abandoned one (see :func:`part_abandoned`).
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import time
import uuid
from collections.abc import Callable

from filelock import FileLock

__all__ = [
    "MOUNTS",
    "NETWORK_FS",
    "PART",
    "STALE_PART_SECONDS",
    "cache_subdir",
    "default_cache_dir",
    "host_tag",
    "network_fs",
    "part_abandoned",
    "part_path",
    "publish",
    "written_elsewhere",
]

#: the infix of a file being written (``<target>.part-<pid>-<host>-<random>``)
PART = ".part-"

#: a ``.part-`` file of another host counts as abandoned once untouched this long
STALE_PART_SECONDS = 3600.0

#: file system types (as ``/proc/mounts`` names them) served over a network: memory maps
#: of them are slow, their locks unreliable
NETWORK_FS = frozenset(
    {"nfs", "nfs4", "cifs", "smb3", "smbfs", "afs", "lustre", "gpfs", "glusterfs",
     "fuse.glusterfs", "ceph", "fuse.ceph", "fuse.sshfs", "sshfs", "beegfs", "9p",
     "fuse.s3fs", "fuse.gcsfuse", "fuse.goofys", "fuse.rclone", "fuse.juicefs", "wekafs"}
)  # fmt: skip


#: where :func:`network_fs` reads the mounted file systems
MOUNTS = "/proc/mounts"


def default_cache_dir() -> str:
    """``$EVENLY_CACHE_DIR``, else ``~/.cache/evenly``."""
    return os.environ.get("EVENLY_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "evenly"
    )


def cache_subdir(kind: str, cache_dir: str | None = None) -> str:
    """``<cache_dir>/<kind>``, created if needed (``cache_dir`` defaults to
    :func:`default_cache_dir`).

    >>> import os
    >>> d = cache_subdir("doctest", "/tmp/evenly-cache-doctest")
    >>> d.endswith(os.path.join("evenly-cache-doctest", "doctest")), os.path.isdir(d)
    (True, True)
    """
    path = os.path.abspath(os.path.join(cache_dir or default_cache_dir(), kind))
    os.makedirs(path, exist_ok=True)
    return path


def network_fs(path: str, mounts: str | None = None) -> str | None:
    """The type of the network file system holding ``path`` (``"nfs4"``...), or None
    for a local one (or where it cannot be told).  ``mounts`` is ``/proc/mounts``-style
    text (read from :data:`MOUNTS` when not given).

    >>> text = "/dev/sda1 / ext4 rw 0 0\\nsrv:/home /home nfs4 rw 0 0\\n"
    >>> network_fs("/home/me/.cache/evenly", text), network_fs("/tmp/x", text)
    ('nfs4', None)
    """
    if mounts is None:
        try:
            with open(MOUNTS, encoding="utf-8", errors="replace") as f:
                mounts = f.read()
        except OSError:
            return None
    target = os.path.realpath(path)
    best, kind = "", ""
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, fields[2]
    return kind if kind in NETWORK_FS else None


def host_tag() -> str:
    """This host as ``.part-`` names record it: its host name and PID namespace (the
    processes a pid can be checked against, the locks that reach one another).

    >>> bool(re.fullmatch(r"[A-Za-z0-9._-]+(~[0-9]+)?", host_tag()))
    True
    """
    name = re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname()) or "host"
    with contextlib.suppress(OSError):
        namespace = os.readlink("/proc/self/ns/pid")  # 'pid:[4026531836]'
        name += "~" + "".join(c for c in namespace if c.isdigit())
    return name


def part_path(target: str) -> str:
    """A unique name to write ``target`` at before it is renamed into place:
    ``<target>.part-<pid>-<host>-<random>`` (the writer's pid and :func:`host_tag`)."""
    return f"{target}{PART}{os.getpid()}-{host_tag()}-{uuid.uuid4().hex[:8]}"


def written_elsewhere(part: str) -> bool:
    """Whether the ``.part-`` file ``part`` names another host than this one (a name
    without a host, from an older version, counts as this host's).

    >>> written_elsewhere("/c/x.part-12-node-b~4026531836-0123abcd"), written_elsewhere(
    ...     part_path("/c/x")), written_elsewhere("/c/x.part-12-0123abcd")
    (True, False, False)
    """
    fields = os.path.basename(part).partition(PART)[2].split("-")
    return len(fields) >= 3 and "-".join(fields[1:-1]) != host_tag()


def part_abandoned(part: str, lock_free: Callable[[], bool]) -> bool:
    """Whether the writer of the ``.part-`` file ``part`` is gone.

    One written on this host: its process is dead, or ``lock_free()`` (its entry's lock
    can be taken).  One of another host (a node sharing ``cache_dir``): neither a pid nor
    a lock of this host says anything about it, so only once it has been left untouched
    for :data:`STALE_PART_SECONDS`.
    """
    if written_elsewhere(part):
        try:
            return time.time() - os.stat(part).st_mtime > STALE_PART_SECONDS
        except FileNotFoundError:
            return False
    fields = os.path.basename(part).partition(PART)[2].split("-")
    if fields[0].isdigit():
        try:
            os.kill(int(fields[0]), 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
    return lock_free()


def publish(target: str, write: Callable[[str], None]) -> str:
    """Make ``target`` exist, written once per machine by whichever process comes first.

    ``write(tmp)`` writes the whole file at ``tmp`` (a ``.part-`` name beside ``target``);
    it is renamed into place only when ``write`` returns, so a reader never sees a partial
    file; on error the partial file is removed, and one left by a killed process has a
    unique name no reader opens.  Other processes wait on the target's lock, then find it.

    >>> import os, pathlib
    >>> t = os.path.join(cache_subdir("doctest", "/tmp/evenly-cache-doctest"), "x.bin")
    >>> if os.path.exists(t): os.unlink(t)
    >>> _ = publish(t, lambda tmp: pathlib.Path(tmp).write_bytes(b"abc"))
    >>> pathlib.Path(t).read_bytes()
    b'abc'
    """
    if os.path.exists(target):
        return target
    os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
    with FileLock(target + ".lock"):
        if os.path.exists(target):
            return target
        tmp = part_path(target)
        try:
            write(tmp)
            os.replace(tmp, target)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
    return target
