"""Rank processes that take every process they started with them when they are stopped.

A rank calls ``detach()`` first: it becomes the leader of a new session, so its DataLoader
workers (and anything they start) share its process group.  ``stop(procs)`` ends each
rank and then its whole group, and waits until no process of it runs: killing only the
rank would leave a worker blocked in the dataset's ``__iter__`` running forever,
re-parented to init.  The audit calls it on every exit path: success, timeout, a failing
rank, Ctrl-C, and SIGTERM or SIGHUP while ``exit_on_signals()`` is active (they would
otherwise end the audit process at once and leave its ranks running).  Detaching also
keeps a terminal's Ctrl-C away from the ranks: the audit process gets it and stops them
in order.

>>> import multiprocessing
>>> p = multiprocessing.get_context("spawn").Process(target=detach)
>>> p.start()
>>> stop([p], grace=30.0)
[]
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator, Sequence
from multiprocessing.process import BaseProcess
from pathlib import Path
from types import FrameType

__all__ = ["detach", "exit_on_signals", "group_running", "stop"]

#: Seconds ``stop`` waits for a killed group's processes to be gone.
KILL_WAIT = 10.0
_POLL = 0.05


def detach() -> None:
    """Make this process the leader of a new session and process group (POSIX only)."""
    setsid = getattr(os, "setsid", None)
    if setsid is not None:
        with contextlib.suppress(PermissionError):  # already a group leader
            setsid()


def group_running(pgid: int) -> list[int]:
    """The pids of group ``pgid`` that still run (zombies awaiting their reaper are done).

    Reads ``/proc`` where there is one; elsewhere says ``[pgid]`` while the group exists.
    """
    proc = Path("/proc")
    if not (proc / "self" / "stat").exists():
        killpg = getattr(os, "killpg", None)
        if killpg is None:
            return []
        try:
            killpg(pgid, 0)
        except ProcessLookupError:
            return []
        except PermissionError:
            pass
        return [pgid]
    running = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses.
        fields = stat.rpartition(")")[2].split()
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            running.append(int(entry.name))
    return sorted(running)


def _kill_group(pgid: int) -> None:
    killpg = getattr(os, "killpg", None)
    if killpg is None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        killpg(pgid, signal.SIGKILL)


def stop(procs: Sequence[BaseProcess], *, grace: float) -> list[int]:
    """Give each rank ``grace`` seconds (in all) to exit, then kill it and every process of
    its group; return the pids still running after ``KILL_WAIT`` seconds (normally none).
    """
    deadline = time.monotonic() + grace
    for p in procs:
        if p.pid is not None:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
    groups = []
    for p in procs:
        if p.pid is None:  # never started
            continue
        if p.is_alive():
            p.kill()  # first, so that it starts nothing more
        _kill_group(p.pid)  # a detached rank's pid is its group's id
        p.join()
        groups.append(p.pid)
    left: list[int] = []
    deadline = time.monotonic() + KILL_WAIT
    for pgid in groups:
        while running := group_running(pgid):
            if time.monotonic() > deadline:
                left.extend(running)
                break
            _kill_group(pgid)
            time.sleep(_POLL)
    return left


def _exit(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def exit_on_signals() -> Iterator[None]:
    """Within the block, SIGTERM and SIGHUP raise ``SystemExit`` (so ``finally`` clauses
    run and stop the ranks) instead of ending the process at once.

    Only in the main thread, and only for signals whose handler is still the default;
    the previous handlers are restored on exit.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {}
    for name in ("SIGTERM", "SIGHUP"):
        signum = getattr(signal, name, None)
        if signum is not None and signal.getsignal(signum) is signal.SIG_DFL:
            previous[signum] = signal.signal(signum, _exit)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
