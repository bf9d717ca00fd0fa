"""The one place node-local files live: ``cache_dir`` and its sub-directories.

Every file evenly keeps on a machine (remote shard copies, manifests, packing's lengths,
decoded rows) lives under one ``cache_dir`` (``$EVENLY_CACHE_DIR``, else
``~/.cache/evenly``), one sub-directory per kind, shared by every process of the user on
the node.  Files are written once, by whichever process comes first, through
:func:`publish`: a reader never sees a partial file, a killed writer leaves nothing a
reader trusts.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Callable

from filelock import FileLock

__all__ = [
    "MOUNTS",
    "NETWORK_FS",
    "PART",
    "cache_subdir",
    "default_cache_dir",
    "network_fs",
    "publish",
]

#: the infix of a file being written (``<target>.part-<pid>-<random>``)
PART = ".part-"

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
        tmp = f"{target}{PART}{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            write(tmp)
            os.replace(tmp, target)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
    return target
