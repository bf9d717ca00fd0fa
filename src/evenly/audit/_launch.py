"""Start a group of real rank processes, run one task in each, and collect the results.

Each rank is a fresh process (forked from a fork server that imported torch once per
audit session, or spawned where there is none) with ``RANK``/``WORLD_SIZE``/
``LOCAL_RANK``/``MASTER_*`` set and a gloo process group on 127.0.0.1, so code that asks
``torch.distributed`` sees the truth.  ``launch(world_size, timeout, task, payload)``
calls the module-level ``task(rank, payload)`` in every rank and returns the results in
rank order; every process it started (DataLoader workers included) is stopped on every
exit path.  The caller's ``sys.path``, environment and working directory travel with the
task (a fork server keeps the ones it started with).

With ``nodes=N`` the ranks are N simulated nodes of ``world_size / N`` ranks each: every
rank gets the variables torchrun's agent gives a worker of a multi-node job
(``GROUP_RANK`` = its node, ``LOCAL_RANK`` within it, ``LOCAL_WORLD_SIZE``,
``GROUP_WORLD_SIZE``, ``ROLE_*``, ``TORCHELASTIC_*``), and, on Linux as root, its own
host name ``evenly-node-<node>`` in a UTS namespace of its own (``unshare(2)``; the
ranks of a node share the name, so code keyed by host name sees N hosts).  The
namespace is entered after the process group is up (gloo picks its address by resolving
the host name) and before the task runs; DataLoader workers inherit it.  One namespace a
rank, not a node: each rank is forked on its own from the fork server; a namespace holds
only the host and domain names, so ranks with the same name cannot tell the difference.
Where that is not allowed, the ranks keep the machine's host name and ``seen_here`` says
why.

Every rank takes every process it started with it when it is stopped.  A rank calls
``detach()`` first: it becomes the leader of a new session, so its DataLoader workers
(and anything they start) share its process group.  ``stop(procs)`` ends each rank and
then its whole group, and waits until no process of it runs: killing only the rank
would leave a worker blocked in the dataset's ``__iter__`` running forever, re-parented
to init.  ``launch`` calls it on every exit path: success, timeout, a failing rank,
Ctrl-C, and SIGTERM or SIGHUP while ``exit_on_signals()`` is active (they would
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
import ctypes
import multiprocessing
import os
import pickle
import queue as queue_mod
import random
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from multiprocessing import forkserver
from multiprocessing.process import BaseProcess
from pathlib import Path
from types import FrameType
from typing import Any, TypeVar

from ._types import AuditError, ranks_per_node

__all__ = [
    "detach",
    "exit_on_signals",
    "free_port",
    "group_running",
    "launch",
    "rank_env",
    "seen_here",
    "start_fork_server",
    "stop",
    "working_on",
]

#: What the fork server imports once: a rank forked from it starts without ``import torch``.
PRELOAD = ["torch", "evenly.audit._resume"]

#: What this rank process is doing, for the message if it fails (see ``working_on``).
_CURRENT = ["process group setup"]


def working_on(what: str) -> None:
    """Name what this rank does now (a factory), for the message if it fails."""
    _CURRENT[0] = what


#: The queue to the audit process, in a rank (for ``tell``).
_OUT: list[Any] = [None]
#: ``ok`` of a message that is progress, not a result.
_PROGRESS = "progress"


def tell(text: str) -> None:
    """From rank 0: a progress line for the audit process (its status line shows it)."""
    if _OUT[0] is not None:
        _OUT[0].put((0, _PROGRESS, text))


P = TypeVar("P")
R = TypeVar("R")


#: A simulated node's host name is this and its number.
HOST_PREFIX = "evenly-node-"
#: ``unshare(2)``'s flag for a new UTS namespace (host and domain name), from <sched.h>.
_CLONE_NEWUTS = 0x04000000
#: Why this rank kept the machine's host name (None: it has its node's own, or 1 node).
_HOST_NOTE: list[str | None] = [None]


def rank_env(rank: int, world_size: int, port: int, nodes: int = 1) -> dict[str, str]:
    """The environment torchrun gives rank ``rank`` of a group on 127.0.0.1: one node, or
    ``nodes`` nodes of ``world_size / nodes`` ranks (its agent's variables for a worker;
    rank 0 hosts the store, as without an agent: ``TORCHELASTIC_USE_AGENT_STORE=False``).

    >>> env = rank_env(3, 4, 29500, nodes=2)
    >>> [env[k] for k in ("RANK", "GROUP_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")]
    ['3', '1', '1', '2']
    """
    env = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world_size),
    }
    if nodes == 1:
        return env
    local = ranks_per_node(world_size, nodes)
    return {
        **env,
        "LOCAL_RANK": str(rank % local),
        "LOCAL_WORLD_SIZE": str(local),
        "GROUP_RANK": str(rank // local),
        "GROUP_WORLD_SIZE": str(nodes),
        "ROLE_NAME": "default",
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(world_size),
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_RUN_ID": "none",
        "TORCHELASTIC_USE_AGENT_STORE": "False",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
    }


def own_host_name(node: int) -> str | None:
    """Enter a new UTS namespace named ``evenly-node-<node>`` (this process and what it
    starts); return why not (not Linux, not root, unshare refused), or None when done."""
    if not sys.platform.startswith("linux"):
        return f"needs Linux, this is {sys.platform}"
    if os.geteuid() != 0:
        return "needs root for unshare(CLONE_NEWUTS)"
    unshare = getattr(ctypes.CDLL(None, use_errno=True), "unshare", None)
    if unshare is None:
        return "the C library has no unshare(2)"
    if unshare(_CLONE_NEWUTS) != 0:
        return f"unshare(CLONE_NEWUTS) refused: {os.strerror(ctypes.get_errno())}"
    try:
        socket.sethostname(f"{HOST_PREFIX}{node}")
    except OSError as exc:
        return f"sethostname refused in the new UTS namespace: {exc.strerror}"
    return None


def seen_here() -> dict[str, Any]:
    """What this rank process sees of its place: torchrun's variables (None where unset),
    its host name and why it is not its node's own (``host_note``)."""

    def number(name: str) -> int | None:
        raw = os.environ.get(name, "")
        return int(raw) if raw.lstrip("-").isdigit() else None

    return {
        "rank": number("RANK"),
        "node": number("GROUP_RANK"),
        "local_rank": number("LOCAL_RANK"),
        "local_world_size": number("LOCAL_WORLD_SIZE"),
        "host": socket.gethostname(),
        "host_note": _HOST_NOTE[0],
    }


def _rank_main(rank: int, world_size: int, nodes: int, port: int, job: bytes, out: Any) -> None:
    # Deferred: importing this module must stay light (``start_fork_server`` runs before
    # the audit process imports torch); a rank has them preloaded.
    import numpy as np
    import torch
    import torch.distributed as dist

    detach()  # its own process group: stopping the audit stops its workers too
    # The fork server started with an older view of the caller: take the current one
    # before the task (the user's factory) is unpickled.
    where: dict[str, Any] = pickle.loads(job[: int.from_bytes(job[:8], "little") + 8][8:])
    sys.path[:] = where["path"]
    os.environ.clear()
    os.environ.update(where["environ"])
    os.chdir(where["cwd"])
    # A forked rank would share the server's random streams: seed them from the OS, as
    # a fresh interpreter does (the audit checks that ranks do not share streams).
    random.seed()
    np.random.seed()
    torch.seed()
    os.environ.update(rank_env(rank, world_size, port, nodes))
    # A spawned process inherits "spawn" as its start method; a rank started by torchrun
    # has the platform's default (fork on Linux), which is what DataLoader workers use.
    multiprocessing.set_start_method(multiprocessing.get_all_start_methods()[0], force=True)
    torch.set_num_threads(1)
    _OUT[0] = out if rank == 0 else None
    try:
        task, payload = pickle.loads(job[int.from_bytes(job[:8], "little") + 8 :])
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        if nodes > 1:
            _HOST_NOTE[0] = own_host_name(rank // ranks_per_node(world_size, nodes))
        try:
            out.put((rank, True, task(rank, payload)))
        finally:
            dist.destroy_process_group()
    except BaseException:
        out.put((rank, False, f"while auditing {_CURRENT[0]}:\n{traceback.format_exc()}"))


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


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _gather(
    procs: list[Any],
    out: Any,
    timeout: float,
    results: dict[int, Any],
    progress: Callable[[str], None] | None = None,
) -> None:
    """Fill ``results`` (rank -> result) from the ranks; raise ``AuditError`` when a rank
    fails, dies or the audit runs past ``timeout``."""
    world_size = len(procs)
    deadline = time.monotonic() + timeout
    while len(results) < world_size:
        try:
            rank, ok, value = out.get(timeout=min(1.0, max(0.01, deadline - time.monotonic())))
        except queue_mod.Empty:
            dead = [r for r, p in enumerate(procs) if p.exitcode is not None and r not in results]
            if dead:
                code = procs[dead[0]].exitcode
                raise AuditError(
                    f"rank {dead[0]} exited with code {code} before reporting; every rank "
                    f"process and its DataLoader workers were stopped"
                ) from None
            if time.monotonic() > deadline:
                waiting = [r for r in range(world_size) if r not in results]
                raise AuditError(
                    f"the audit did not finish within its timeout of {timeout:g} s "
                    f"(--timeout / timeout=): rank(s) {waiting} had not reported. A rank is "
                    f"stuck: a dataset or worker that never ends, or a collective that only "
                    f"some ranks join? Every rank process and its DataLoader workers were "
                    f"stopped; raise the timeout if the dataset is only slow"
                ) from None
            continue
        if ok == _PROGRESS:
            if progress is not None:
                progress(value)
            continue
        if not ok:
            raise AuditError(f"rank {rank} failed {value}")
        results[rank] = value


def _context() -> Any:
    """A fork server that imported torch and the audit once (a rank forked from it starts
    in a fraction of a spawn's time: ``import torch`` is most of a fresh process's start),
    where the platform has one; else spawn."""
    import torch.multiprocessing as mp  # deferred: see _rank_main

    if "forkserver" not in multiprocessing.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def start_fork_server() -> None:
    """Start the fork server now, where the platform has one: it imports torch and the
    audit in the background while this process goes on (its own imports, the first
    rank group's setup), instead of before the first rank can fork."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return
    multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
    forkserver.ensure_running()


def launch(
    world_size: int,
    timeout: float,
    task: Callable[[int, P], R],
    payload: P,
    progress: Callable[[str], None] | None = None,
    nodes: int = 1,
) -> list[R]:
    """``task(rank, payload)`` in ``world_size`` fresh rank processes on ``nodes``
    simulated nodes; results by rank (``progress`` gets rank 0's ``tell`` lines)."""
    ranks_per_node(world_size, nodes)
    try:
        body = pickle.dumps((task, payload))
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        raise AuditError(
            f"the factory and id_fn travel to the rank processes by pickle and must be "
            f"module-level functions (or functools.partial of one), not lambdas or local "
            f"functions: {exc}"
        ) from exc
    where = pickle.dumps({"path": list(sys.path), "environ": dict(os.environ), "cwd": os.getcwd()})
    job = len(where).to_bytes(8, "little") + where + body
    ctx = _context()
    out = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(r, world_size, nodes, port, job, out))
        for r in range(world_size)
    ]
    try:
        for p in procs:
            p.start()
    except BaseException:
        stop(procs, grace=0.0)
        raise
    results: dict[int, Any] = {}
    with exit_on_signals():
        try:
            _gather(procs, out, timeout, results, progress)
        finally:
            left = stop(procs, grace=10.0 if len(results) == world_size else 0.5)
            if left:
                raise AuditError(
                    f"processes {left} started by the audit still run after SIGKILL "
                    f"(uninterruptible I/O?); stop them by pid"
                )
    return [results[r] for r in range(world_size)]
