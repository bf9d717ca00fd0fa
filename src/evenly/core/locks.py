"""A lock that a forked process gets released.

``os.fork`` copies a ``threading.Lock`` in the state it had, but not the threads: a lock
that a reader thread of the parent held at that instant (an abandoned
``worker_type="thread"`` pass still finishing its read while the next loader forks its
workers) stays held in the child for ever, and the worker that asks for it hangs.
:class:`ForkSafeLock` is a new, free lock in every forked child (``os.register_at_fork``),
and in every unpickled copy; in one process it is a plain lock.

>>> lock = ForkSafeLock()
>>> with lock:
...     lock.locked()
True
>>> lock.locked()
False
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any

__all__ = ["ForkSafeLock"]


class ForkSafeLock:
    """A ``threading.Lock`` (``with lock:``, ``acquire``, ``release``) that is free again
    in a forked child and in an unpickled copy."""

    __slots__ = ("__weakref__", "_lock")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        _LIVE.add(self)

    def __enter__(self) -> bool:
        return self._lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        return self._lock.acquire(blocking, timeout)

    def release(self) -> None:
        self._lock.release()

    def locked(self) -> bool:
        return self._lock.locked()

    def __getstate__(self) -> dict[str, Any]:
        return {"free": True}  # a copy starts free (an empty state would skip this)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]

    def _renew(self) -> None:
        self._lock = threading.Lock()


#: every ForkSafeLock of this process, renewed in a forked child
_LIVE: weakref.WeakSet[ForkSafeLock] = weakref.WeakSet()


def _renew_all() -> None:
    for lock in list(_LIVE):
        lock._renew()


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_renew_all)
