"""The dataset's own passes: which epoch each pass is when the dataset runs under a loader
that is not evenly's (a plain torch DataLoader, one that a framework rebuilt,
StatefulDataLoader), so that epochs advance by themselves and every worker of one pass
reads the same epoch.

A pass is counted in the process that runs it.  Its workers recognise one another by
the pass's key, ``(base seed, passes this process ran before)``: every worker of one
``iter(loader)`` shares the loader's base seed (torch gives worker ``i`` the seed
``base + i``), and persistent workers count their passes alike.  The first worker of a
pass to start gives it the epoch: the one ``set_epoch``/``load_state_dict`` asked for,
else the epoch after the last pass; the others find it under the key.  So two loaders
over one dataset each get whole passes (the epochs are numbered in the order their
passes start): no worker of one loader ever advances another loader's pass.  With
``num_workers=0`` a pass runs in the main process, and each ``iter()`` is the next pass.

The table lives in shared memory (workers started with fork, spawn or forkserver see
it); a file lock keeps its updates whole.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import uuid
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from filelock import FileLock

from evenly.core.passes import after_set_epoch
from evenly.core.state import PassState
from evenly.runtime.channel import SharedJson
from evenly.runtime.torch_compat import worker_base_seed

__all__ = ["OwnPasses", "PassKey"]

#: Passes remembered (a pass's workers all start within moments of one another).
_RING = 64
# header slots
_SERIAL, _EPOCH, _POSITION, _BATCHES, _LOADED, _CONSUMED = range(6)
_LAST_EPOCH, _LAST_POSITION, _LAST_IN_WORKER, _STARTED, _NEXT_SLOT = range(6, 11)
# the last pass's key (0: the main process), its processes and how many finished
_LAST_KEY, _LAST_PROCESSES, _LAST_DONE = range(11, 14)
_HEADER = 16

PassKey = int | None


@dataclass
class _Local:
    """What this process knows of its own passes."""

    #: passes this process has started (half of a pass's key)
    passes: int = 0
    #: a worker restored by StatefulDataLoader: its next pass and the samples of its
    #: share it had yielded
    resume: tuple[PassState, int] | None = None
    #: the pass this process runs (or ran last)
    running: PassState | None = None


def _remove(path: str) -> None:
    for name in (path, path + ".lock"):
        with contextlib.suppress(OSError):
            os.unlink(name)


class OwnPasses:
    """The table of a dataset's own passes (shared by the main process and its workers)."""

    def __init__(self) -> None:
        table = torch.zeros(_HEADER + 3 * _RING, dtype=torch.int64)
        table[_LAST_EPOCH] = -1
        self._table: torch.Tensor = table.share_memory_()  # type: ignore[no-untyped-call]
        #: the source parts (a Mix's): of the last request, and what holds for every pass
        self._parts = SharedJson("the dataset's loaded pass state")
        self._parts.publish({"request": None, "anchor": None})
        self._path = os.path.join(tempfile.gettempdir(), f"evenly-passes-{uuid.uuid4().hex}")
        weakref.finalize(self, _remove, self._path)
        self._local = _Local()
        #: (calls, epoch) of set_epoch in this process, for an evenly.DataLoader to follow
        self.epoch_calls: tuple[int, int] = (0, 0)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_local"] = _Local()  # a copy counts its own passes
        return state

    def _lock(self) -> FileLock:
        return FileLock(self._path + ".lock")

    # ---- asked for in the main process -----------------------------------------
    def _with_part(self, epoch: int, position: int, batches: int = 0) -> PassState:
        """A pass state with its source part: the request's where it starts at the
        request's position inside an epoch, else what holds for every pass."""
        parts = self._parts.read()
        t = self._table.tolist()
        resumes = position > 0 and (t[_EPOCH], t[_POSITION]) == (epoch, position)
        return PassState(epoch, position, batches, parts["request" if resumes else "anchor"])

    def _pending(self, t: list[int]) -> PassState | None:
        if t[_CONSUMED] == t[_SERIAL]:
            return None
        return self._with_part(t[_EPOCH], t[_POSITION], t[_BATCHES])

    def _request(self, state: PassState, loaded: bool, anchor: Any) -> None:
        t = self._table
        t[_EPOCH], t[_POSITION], t[_BATCHES] = state.epoch, state.position, state.batches
        t[_LOADED] = int(loaded)
        self._parts.publish({"request": state.source, "anchor": anchor})
        t[_SERIAL] += 1

    def set_epoch(self, epoch: int) -> None:
        """The next pass is epoch ``epoch`` (a loaded state of it keeps its position)."""
        with self._lock():
            t = self._table.tolist()
            anchor = self._parts.read()["anchor"]
            state = after_set_epoch(self._pending(t), bool(t[_LOADED]), epoch)
            self._request(state, bool(t[_LOADED]) and state.resumes, anchor)
        self.epoch_calls = (self.epoch_calls[0] + 1, epoch)

    def load(self, state: PassState, carried: Any = None) -> None:
        """The next pass continues ``state``; ``carried`` holds for every later pass."""
        with self._lock():
            self._request(state, loaded=True, anchor=carried)

    def restore_worker(self, state: PassState, yielded: int) -> None:
        """In a worker restored by StatefulDataLoader: its next pass continues ``state``,
        after the ``yielded`` samples of its share it had handed out."""
        self._local.resume = (state, yielded)

    # ---- where things stand ------------------------------------------------------
    def current(self) -> PassState:
        """The pass in progress, or the next one: the one asked for if no pass started
        since the request, else the one after the last pass once every process of it
        finished its share."""
        t = self._table.tolist()
        pending = self._pending(t)
        if pending is not None:
            return pending
        if t[_LAST_EPOCH] < 0:
            return self._with_part(0, 0)
        if t[_LAST_DONE] >= t[_LAST_PROCESSES]:
            return self._with_part(t[_LAST_EPOCH] + 1, 0)
        return self._with_part(t[_LAST_EPOCH], t[_LAST_POSITION])

    def last(self) -> PassState:
        """The last pass started (finished or not), or the next one if none started since
        the last request: what a checkpoint of the loop's progress is taken in."""
        t = self._table.tolist()
        pending = self._pending(t)
        if pending is not None or t[_LAST_EPOCH] < 0:
            return self.current()
        return self._with_part(t[_LAST_EPOCH], t[_LAST_POSITION])

    def finish(self, key: PassKey) -> None:
        """This process has read its whole share of the pass keyed ``key``."""
        with self._lock():
            if int(self._table[_LAST_KEY]) == (key or 0):
                self._table[_LAST_DONE] += 1

    def last_ran_in_a_worker(self) -> bool:
        """Whether the last pass started ran in DataLoader workers (so this process
        cannot know how much of it the loop received)."""
        return bool(self._table[_LAST_IN_WORKER])

    @property
    def running(self) -> PassState | None:
        """The pass this process runs (or ran last)."""
        return self._local.running

    # ---- a pass starts (in the process that runs it) -----------------------------------
    def key(self, worker: Any) -> PassKey:
        """This process's key for the pass it starts (``None`` in the main process)."""
        count = self._local.passes
        self._local.passes += 1
        if worker is None:
            return None
        return hash((worker_base_seed(worker), count)) % (1 << 62) + 1

    def begin(self, key: PassKey, processes: int = 1) -> tuple[PassState, int]:
        """The pass keyed ``key`` (read by ``processes`` workers) starts here: its
        (epoch, start), and the samples of this process's share to skip (a restored
        worker)."""
        local = self._local
        skip = 0
        with self._lock():
            t = self._table.tolist()
            found = None if key is None else self._find(t, key)
            restored = local.resume is not None
            if local.resume is not None:
                state, skip = local.resume
                local.resume = None
            elif found is not None:
                state = found
            else:
                pending = self._pending(t)
                if pending is not None:
                    state = pending
                    self._table[_CONSUMED] = t[_SERIAL]
                    self._table[_STARTED] = 0
                else:
                    state = self._with_part(t[_LAST_EPOCH] + 1, 0)
            if found is None or restored:
                fresh = not (restored and key is not None and t[_LAST_KEY] == key)
                self._record(t, key, state, processes if fresh else None)
        local.running = state
        return state, skip

    def _find(self, t: list[int], key: int) -> PassState | None:
        for slot in range(_RING):
            at = _HEADER + 3 * slot
            if t[at] == key:
                return self._with_part(t[at + 1], t[at + 2])
        return None

    def _record(self, t: list[int], key: PassKey, state: PassState, processes: int | None) -> None:
        """Record a pass that starts (``processes``: how many will read it; ``None``: a
        restored worker of a pass already recorded)."""
        table = self._table
        table[_LAST_EPOCH], table[_LAST_POSITION] = state.epoch, state.position
        if processes is not None:
            table[_LAST_KEY], table[_LAST_PROCESSES], table[_LAST_DONE] = key or 0, processes, 0
        table[_LAST_IN_WORKER] = int(key is not None)
        table[_STARTED] += 1
        if key is None:
            return
        same = [s for s in range(_RING) if t[_HEADER + 3 * s] == key]
        slot = same[0] if same else t[_NEXT_SLOT] % _RING
        at = _HEADER + 3 * slot
        table[at], table[at + 1], table[at + 2] = key, state.epoch, state.position
        if not same:
            table[_NEXT_SLOT] = slot + 1
