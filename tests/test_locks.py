"""``ForkSafeLock``: a lock a thread of the parent held when a worker was forked is free
in the worker (a plain ``threading.Lock`` stays held there for ever)."""

from __future__ import annotations

import multiprocessing
import pickle
import threading
from typing import Any

import pytest

from evenly.core.locks import ForkSafeLock


def _take(lock: Any, wait: float, out: Any) -> None:
    out.put(lock.acquire(timeout=wait))


def _acquired_in_a_forked_child(lock: Any, wait: float) -> bool:
    """Fork a child while another thread of this process holds ``lock``; whether the
    child could take it within ``wait`` seconds."""
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with lock:
            held.set()
            release.wait(60)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert held.wait(20)
        ctx = multiprocessing.get_context("fork")
        out = ctx.Queue()
        child = ctx.Process(target=_take, args=(lock, wait, out))
        child.start()
        got = out.get(timeout=60)
        child.join(60)
        return bool(got)
    finally:
        release.set()
        holder.join()


def test_a_lock_held_by_a_parent_thread_at_the_fork_is_free_in_the_child() -> None:
    assert _acquired_in_a_forked_child(ForkSafeLock(), wait=30)


def test_a_plain_lock_held_at_the_fork_stays_held_in_the_child() -> None:
    # the hazard ForkSafeLock removes (so the test above can fail)
    assert not _acquired_in_a_forked_child(threading.Lock(), wait=2)


def test_a_pickled_copy_starts_free_and_the_lock_excludes() -> None:
    lock = ForkSafeLock()
    with lock:
        copy = pickle.loads(pickle.dumps(lock))
        assert lock.locked() and not copy.locked()
        assert not lock.acquire(blocking=False)
    assert lock.acquire(blocking=False)
    lock.release()
    with pytest.raises(RuntimeError):
        lock.release()
