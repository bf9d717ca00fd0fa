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
import errno
import os
import re
import socket
import time
import uuid
from collections.abc import Callable

from filelock import FileLock

__all__ = [
    "ENTRY_MARK",
    "ENV_DIR",
    "LOCK_POLL",
    "MOUNTS",
    "NETWORK_FS",
    "PART",
    "STALE_PART_SECONDS",
    "CacheDirError",
    "cache_subdir",
    "default_cache_dir",
    "host_tag",
    "network_fs",
    "part_abandoned",
    "part_path",
    "publish",
    "remove_abandoned_parts",
    "unwritable",
    "where_from",
    "written_elsewhere",
]

#: the infix of a file being written (``<target>.part-<pid>-<host>-<random>``)
PART = ".part-"
#: what follows a shard's name in the name of a decoded row group kept beside it in the
#: shard cache (``<shard>@rg<g>-<hash>.arrow``, see :mod:`evenly.sources._rowcache`)
ENTRY_MARK = "@"

#: a ``.part-`` file of another host counts as abandoned once untouched this long
STALE_PART_SECONDS = 3600.0

#: seconds between two tries of a cache lock held for a few milliseconds (the eviction
#: pass, another process's download a reader waits for); filelock's default of 0.05 s
#: added about 40 ms to each eviction after a download in a 2-worker remote epoch
LOCK_POLL = 0.002

#: file system types (as ``/proc/mounts`` names them) served over a network: memory maps
#: of them are slow, their locks unreliable
NETWORK_FS = frozenset(
    {
        "nfs",
        "nfs4",
        "cifs",
        "smb3",
        "smbfs",
        "afs",
        "lustre",
        "gpfs",
        "glusterfs",
        "fuse.glusterfs",
        "ceph",
        "fuse.ceph",
        "fuse.sshfs",
        "sshfs",
        "beegfs",
        "9p",
        "fuse.s3fs",
        "fuse.gcsfuse",
        "fuse.goofys",
        "fuse.rclone",
        "fuse.juicefs",
        "wekafs",
    }
)


#: where :func:`network_fs` reads the mounted file systems
MOUNTS = "/proc/mounts"
#: the environment variable naming the cache directory
ENV_DIR = "EVENLY_CACHE_DIR"
#: free bytes below which a write error that names no cause is put down to a full disk
_NEARLY_FULL = 1 << 20


class CacheDirError(OSError):
    """``cache_dir`` (or the file evenly writes in it) cannot be written: a file in the
    path, a read-only file system, no permission, a full disk.  The message names the
    directory, the cause, and the setting to change; ``why`` is the cause alone."""

    def __init__(self, message: str, *, why: str = "", code: int | None = None) -> None:
        super().__init__(message)
        self.why = why or message
        self.errno = code  # type: ignore[assignment]  # typeshed: int; None for no errno


def default_cache_dir() -> str:
    """``$EVENLY_CACHE_DIR``, else ``~/.cache/evenly``."""
    return os.environ.get(ENV_DIR) or os.path.join(os.path.expanduser("~"), ".cache", "evenly")


def where_from(cache_dir: str | None) -> str:
    """How to point the cache elsewhere, given the ``cache_dir`` argument in use.

    >>> where_from("/x")
    'pass cache_dir= a writable local directory with room'
    """
    if cache_dir:
        return "pass cache_dir= a writable local directory with room"
    if os.environ.get(ENV_DIR):
        return (
            f"set ${ENV_DIR} (now {os.environ[ENV_DIR]!r}) to a writable local directory "
            f"with room, or pass cache_dir="
        )
    return (
        f"cache_dir defaults to ~/.cache/evenly: set ${ENV_DIR} or pass cache_dir= a "
        f"writable local directory with room"
    )


def unwritable(directory: str, exc: OSError | None = None) -> str | None:
    """Why nothing can be written in ``directory`` (after ``exc``, a failed write there,
    if given): a file in its path, a read-only file system, no permission, a full disk;
    None if it looks writable (``exc`` then had another cause).

    >>> import tempfile
    >>> unwritable(tempfile.mkdtemp()) is None
    True
    """
    code = getattr(exc, "errno", None)
    if exc is None or code in (errno.ENOTDIR, errno.EEXIST):
        blocking = _file_in_path(directory)
        if blocking is not None:
            return f"{blocking} is a file, not a directory"
    existing = directory
    while not os.path.isdir(existing) and os.path.dirname(existing) != existing:
        existing = os.path.dirname(existing)
    try:
        st = os.statvfs(existing)
    except OSError:
        st = None
    if code == errno.EROFS or (st is not None and st.f_flag & os.ST_RDONLY):
        return f"{existing} is on a read-only file system"
    free = -1 if st is None else st.f_bavail * st.f_frsize
    if code in (errno.ENOSPC, errno.EDQUOT) or (
        exc is not None and code is None and 0 <= free < _NEARLY_FULL
    ):
        space = "" if free < 0 else f" ({free >> 10} KiB free)"
        return f"the disk holding {existing} is full{space}"
    denied = code in (errno.EACCES, errno.EPERM) and str(
        getattr(exc, "filename", "") or ""
    ).startswith(existing)
    if denied or (exc is None and not os.access(existing, os.W_OK)):
        return f"no permission to write in {existing}"
    return None


def _file_in_path(path: str) -> str | None:
    """The first part of ``path`` that exists and is not a directory."""
    parts = os.path.abspath(path).split(os.sep)
    for i in range(2, len(parts) + 1):
        head = os.sep.join(parts[:i])
        if os.path.lexists(head) and not os.path.isdir(head):
            return head
    return None


def cache_error(path: str, cache_dir: str | None, exc: OSError) -> CacheDirError | None:
    """``exc`` (a failed write at ``path``) as a :class:`CacheDirError` naming the cause
    and the setting, or None when the directory is not at fault."""
    if isinstance(exc, CacheDirError):
        return exc
    why = unwritable(os.path.dirname(path), exc)
    if why is None:
        return None
    why = f"{why} (writing {path}: {exc})"
    return CacheDirError(
        f"evenly: cannot write in the cache directory: {why}; {where_from(cache_dir)}",
        why=why,
        code=exc.errno,
    )


def cache_subdir(kind: str, cache_dir: str | None = None) -> str:
    """``<cache_dir>/<kind>``, created if needed (``cache_dir`` defaults to
    :func:`default_cache_dir`); :class:`CacheDirError` if it cannot be.

    >>> import os
    >>> d = cache_subdir("doctest", "/tmp/evenly-cache-doctest")
    >>> d.endswith(os.path.join("evenly-cache-doctest", "doctest")), os.path.isdir(d)
    (True, True)
    """
    path = os.path.abspath(os.path.join(cache_dir or default_cache_dir(), kind))
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        why = f"cannot create {path}: {unwritable(path, exc) or exc}"
        raise CacheDirError(
            f"evenly: {why}; {where_from(cache_dir)}", why=why, code=exc.errno
        ) from exc
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


def remove_abandoned_parts(target: str) -> list[str]:
    """Remove the ``.part-`` files of ``target`` whose writer is gone (best effort); the
    caller holds ``target``'s lock, so no writer of this host is at it: a part of this
    host goes, another host's only once stale (:func:`part_abandoned`).  The paths
    removed."""
    folder, prefix = os.path.split(target)
    prefix += PART
    try:
        names = os.listdir(folder or ".")
    except OSError:
        return []
    removed = []
    for name in names:
        if name.startswith(prefix):
            part = os.path.join(folder, name)
            if part_abandoned(part, lambda: True):
                with contextlib.suppress(OSError):
                    os.unlink(part)
                    removed.append(part)
    return removed


def publish(
    target: str,
    write: Callable[[str], None],
    cache_dir: str | None = None,
    *,
    sweep: bool = True,
) -> str:
    """Make ``target`` exist, written once per machine by whichever process comes first.

    ``write(tmp)`` writes the whole file at ``tmp`` (a ``.part-`` name beside ``target``);
    it is renamed into place only when ``write`` returns, so a reader never sees a partial
    file; on error the partial file is removed, and one left by a killed process has a
    unique name no reader opens, removed (``sweep``: :func:`remove_abandoned_parts`) by
    the next process that writes ``target`` (where an eviction sweeps the directory
    instead, ``sweep=False`` saves the listing).  Other processes wait on the target's
    lock, then find it.
    A write that fails because the directory cannot be written (full, read-only...)
    raises :class:`CacheDirError` naming the cause and the setting to change.

    >>> import os, pathlib
    >>> t = os.path.join(cache_subdir("doctest", "/tmp/evenly-cache-doctest"), "x.bin")
    >>> if os.path.exists(t): os.unlink(t)
    >>> _ = publish(t, lambda tmp: pathlib.Path(tmp).write_bytes(b"abc"))
    >>> pathlib.Path(t).read_bytes()
    b'abc'
    """
    if os.path.exists(target):
        return target
    try:
        os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
        with FileLock(target + ".lock"):
            if os.path.exists(target):
                return target
            if sweep:
                remove_abandoned_parts(target)
            tmp = part_path(target)
            try:
                write(tmp)
                os.replace(tmp, target)
            except OSError as exc:  # diagnosed before the partial file frees its space
                error = cache_error(target, cache_dir, exc)
                if error is None:
                    raise
                raise error from exc
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
    except OSError as exc:
        error = cache_error(target, cache_dir, exc)
        if error is None or error is exc:
            raise
        raise error from exc
    return target
