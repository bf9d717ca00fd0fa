"""A real multi-process harness: ``run_ranks(fn, world_size)`` runs
``fn(rank, world_size, *args)`` in ``world_size`` rank processes with a gloo process group
on 127.0.0.1 (the audit's launcher, ``evenly.audit._launch.launch``: torchrun's
variables, the platform's start method for DataLoader workers, every process stopped on
every exit path) and returns the results in rank order.

``fn`` must be a module-level function (it is pickled) and return something picklable.
A failure in any rank is raised here (``AssertionError``) with that rank's traceback.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

from evenly.audit._launch import free_port, launch, working_on
from evenly.audit._types import AuditError

__all__ = ["free_port", "in_fresh_process", "kill_job", "run_ranks", "start_job", "torchrun"]

ROOT = Path(__file__).resolve().parents[1]


def _like_a_launched_process() -> None:
    """A spawned child inherits the 'spawn' start method; a process started by torchrun
    or a shell has the platform default (fork on Linux), so its DataLoader workers fork."""
    multiprocessing.set_start_method("fork", force=True)


def _call(
    rank: int, payload: tuple[Callable[..., Any], int, tuple[Any, ...], dict[str, str]]
) -> Any:
    fn, world_size, args, env = payload
    working_on(getattr(fn, "__qualname__", repr(fn)))
    os.environ.update(env)
    return fn(rank, world_size, *args)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    env: dict[str, str] | None = None,
    timeout: float = 120.0,
) -> list[Any]:
    """Run ``fn`` in ``world_size`` real gloo ranks and return their results by rank
    (``env``: variables set in each rank before ``fn`` runs)."""
    try:
        return launch(world_size, timeout, _call, (fn, world_size, args, dict(env or {})))
    except AuditError as exc:
        raise AssertionError(str(exc)) from exc


def _fresh_entry(fn: Callable[..., Any], args: tuple[Any, ...], queue: Any) -> None:
    _like_a_launched_process()
    try:
        queue.put((True, fn(*args)))
    except BaseException:
        queue.put((False, traceback.format_exc()))


def in_fresh_process(fn: Callable[..., Any], *args: Any, timeout: float = 120.0) -> Any:
    """Run ``fn(*args)`` in a new spawned (non-daemon) process and return its result."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_fresh_entry, args=(fn, args, queue))
    proc.start()
    try:
        ok, value = queue.get(timeout=timeout)
    finally:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
            proc.join()
    if not ok:
        raise AssertionError(f"the fresh process failed:\n{value}")
    return value


def torchrun(
    script: Path,
    *args: object,
    nproc: int,
    port: int | None = None,
    nnodes: int = 1,
    node_rank: int = 0,
) -> subprocess.Popen[bytes]:
    """Launch ``script`` under torchrun on 127.0.0.1 in a session of its own (its ranks
    run in sessions of their own too: tests kill them by the pids they record)."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        str(nnodes),
        "--nproc-per-node",
        str(nproc),
        "--node-rank",
        str(node_rank),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(port or free_port()),
        str(script),
        *map(str, args),
    ]
    return start_job(cmd)


def start_job(cmd: list[str]) -> subprocess.Popen[bytes]:
    """Start one launcher (``cmd``) of a job in a session of its own, from the repository
    root with the tests importable, its output (stdout and stderr) piped."""
    paths = (os.environ.get("PYTHONPATH"), str(ROOT))
    env = {
        **os.environ,
        "PYTHONWARNINGS": "ignore",
        "PYTHONPATH": os.pathsep.join(p for p in paths if p),
    }
    return subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def kill_job(out: Path, launchers: list[subprocess.Popen[bytes]]) -> None:
    """torchrun runs the ranks in sessions of their own: kill the ranks (by the pids they
    wrote to ``out/rank*.pid``) and the launchers' sessions."""
    for pid_file in out.glob("rank*.pid"):
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
    for proc in launchers:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def wait_for_job(out: Path, launchers: list[subprocess.Popen[bytes]], timeout: float) -> None:
    """Wait for every launcher of a multi-node job to exit 0 within ``timeout`` seconds in
    all; on a failure or a timeout, kill the whole job (:func:`kill_job`) and raise with
    the launchers' output."""
    outputs: list[str] = []
    try:
        deadline = time.monotonic() + timeout
        for proc in launchers:
            text, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            outputs.append(text.decode(errors="replace"))
        codes = [proc.returncode for proc in launchers]
        assert codes == [0] * len(launchers), f"launchers exited with {codes}:\n" + "\n".join(
            outputs
        )
    except BaseException:
        kill_job(out, launchers)
        for proc in launchers:
            proc.communicate(timeout=30)
        raise
