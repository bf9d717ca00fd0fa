"""Batches from DataLoader workers to the main process through reusable shared memory.

Torch hands a batch over by moving each of its tensors into a new shared-memory segment
and sending the segment's file descriptor through a socket; the main process maps it,
and the segment is unmapped again once the batch is freed.  For a batch of a few
hundred KiB that is most of the cost of the hand-off.  Here each worker owns a few
*slots*, each a shared-memory segment mapped once: it copies a batch's arrays into a
free slot and sends only a small description (the batch with each array replaced by a
placeholder, plus offsets, dtypes and shapes).  The main process then either

- hands the training loop tensors that *view the slot* (zero-copy, the default): the
  slot is freed when the last of them is (:mod:`evenly.transport.held`), never before;
  or
- copies the arrays out into ordinary memory and frees the slot at once (``copy``; and
  always once the loop holds ``hold`` zero-copy batches of that worker).

Slots never block: a worker that finds no free slot adds one, up to ``max_slots``, and
past that hands the batch over the way torch does.  Every use of a slot carries a
ticket, and every segment a key, so a late "free" message never frees a slot that was
reused; at a pass start a worker retires (replaces) the segments of slots still in use,
since the loop may hold them or they carried batches an abandoned pass dropped.

A packed batch names its transport by id only; the main process finds the transport in
its :data:`RECEIVERS` registry (see :class:`Receivers` for why that one is per process).
"""

from __future__ import annotations

import contextlib
import os
import struct
import threading
import weakref
from collections import deque
from multiprocessing import Pipe
from multiprocessing.connection import Connection
from multiprocessing.context import get_spawning_popen
from typing import Any

import numpy as np
import torch

from evenly.runtime import torch_compat
from evenly.transport.held import slot_views
from evenly.transport.tree import Meta, fill, plain_collate, shm_free, strip, torch_way

__all__ = ["RECEIVERS", "Packed", "Receivers", "Transport", "plain_collate", "unpack"]

_ALIGN = 64
_RELEASE = struct.Struct("<qqq")  # segment key, slot, ticket
#: zero-copy batches of one worker the loop may hold before later ones are copied
HOLD = 8
_shm_free = shm_free  # looked up here by the writer (tests shrink it)


class Receivers:
    """The main process's transports by id: how a packed batch finds the one that reads it.

    A :class:`Packed` batch crosses torch's result queue pickled, carrying its transport's
    id and nothing else of the main process.  It is unpacked by :func:`unpack`, from the
    loop's iterator or from torch's pin-memory thread (:meth:`Packed.pin_memory`), where
    torch hands over the item alone.  So the lookup is by id in a table of the process
    the item lands in: one registry per process, :data:`RECEIVERS`.  Its values are weak:
    a loader that is dropped takes its transport with it, and a batch of it that arrives
    later raises a clear error (``tests/test_transport.py`` pins both).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_id: weakref.WeakValueDictionary[int, Transport] = weakref.WeakValueDictionary()

    def register(self, transport: Transport) -> None:
        """Make ``transport`` findable by its id (while something else holds it)."""
        with self._lock:
            self._by_id[transport.id] = transport

    def find(self, owner: int) -> Transport | None:
        """The live transport of id ``owner``, if any."""
        with self._lock:
            return self._by_id.get(owner)


#: The process's registry (see :class:`Receivers`).
RECEIVERS = Receivers()


class Packed:
    """A batch whose arrays wait in a worker's slot (what crosses torch's queue)."""

    __slots__ = ("arena", "key", "metas", "owner", "skeleton", "slot", "ticket", "worker")

    def __init__(
        self,
        owner: int,
        worker: int,
        key: int,
        arena: torch.Tensor | None,
        slot: int,
        ticket: int,
        skeleton: Any,
        metas: list[Meta],
    ) -> None:
        self.owner, self.worker, self.key, self.arena = owner, worker, key, arena
        self.slot, self.ticket = slot, ticket
        self.skeleton, self.metas = skeleton, metas

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (
            Packed,
            (
                self.owner,
                self.worker,
                self.key,
                self.arena,
                self.slot,
                self.ticket,
                self.skeleton,
                self.metas,
            ),
        )

    def pin_memory(self, device: Any = None) -> Any:
        """Called by torch's pin-memory thread: the batch, unpacked and pinned."""
        return torch_compat.pin_memory(unpack(self), device)


def unpack(item: Any) -> Any:
    """The batch ``item`` stands for (anything not packed is returned as it is)."""
    if type(item) is not Packed:
        return item
    receiver = RECEIVERS.find(item.owner)
    if receiver is None:
        raise RuntimeError("evenly: a batch arrived from workers of a loader that is gone")
    return receiver.receive(item)


class _Segment:
    """One slot's shared memory in the worker (its key names this segment, not the slot)."""

    __slots__ = ("arena", "confirmed", "key", "size")

    def __init__(self, arena: torch.Tensor, size: int) -> None:
        self.arena, self.size, self.confirmed = arena, size, False
        self.key = int.from_bytes(os.urandom(8), "little") >> 1


class _Writer:
    """A worker's side: its slots' segments, and which slots are in use (slot -> ticket)."""

    def __init__(
        self, owner: int, worker: int, slots: int, max_slots: int, free: Connection | None
    ) -> None:
        self.owner, self.worker = owner, worker
        self.slots, self.max_slots = slots, max(slots, max_slots)
        self.segments: list[_Segment | None] = [None] * slots
        self.busy: dict[int, int] = {}
        self.ticket = 0
        self.disabled = free is None
        self.free = free

    def drain(self) -> None:
        if self.free is None:
            return
        messages: list[tuple[int, int, int]] = []
        try:
            while self.free.poll():
                messages.append(_RELEASE.unpack(self.free.recv_bytes()))
        except (EOFError, OSError):  # the main process closed its end: no more frees
            self.free = None
        for key, slot, ticket in messages:
            segment = self.segments[slot] if slot < len(self.segments) else None
            if segment is not None and segment.key == key:
                segment.confirmed = True
                if self.busy.get(slot) == ticket:
                    del self.busy[slot]

    def reclaim(self) -> None:
        """At a pass start: a slot still in use is held by the loop or carried a batch an
        earlier pass dropped; either way it is never written again (a new segment)."""
        self.drain()
        for slot in self.busy:
            self.segments[slot] = None
        self.busy.clear()

    def _free_slot(self) -> int | None:
        slot = next((s for s in range(len(self.segments)) if s not in self.busy), None)
        if slot is None and len(self.segments) < self.max_slots:
            self.segments.append(None)  # the loop holds batches: one more slot
            slot = len(self.segments) - 1
        return slot

    def _segment(self, slot: int, need: int) -> _Segment | None:
        segment = self.segments[slot]
        if segment is not None and segment.size >= need:
            return segment
        size = -(-need * 5 // 4 // 4096) * 4096
        room = _shm_free() // 2  # leave /dev/shm room (a full one is a SIGBUS)
        if slot >= self.slots and 2 * size > room:  # an extra slot: only where it is cheap
            return None
        if self.slots * size > room:
            self.disabled = True
            return None
        try:
            arena = torch.empty(size, dtype=torch.uint8).share_memory_()  # type: ignore[no-untyped-call]
        except (RuntimeError, OSError):  # no room in /dev/shm: torch's way from now on
            self.disabled = True
            return None
        segment = self.segments[slot] = _Segment(arena, size)
        return segment

    def pack(self, batch: Any) -> Any:
        if self.disabled:
            return torch_way(batch)
        leaves: list[Any] = []
        skeleton = strip(batch, leaves)
        if not leaves:
            return torch_way(batch)
        metas: list[Meta] = []
        offset = 0
        for leaf in leaves:
            metas.append((offset, leaf.dtype, tuple(leaf.shape), type(leaf) is np.ndarray))
            offset += -(-int(leaf.nbytes) // _ALIGN) * _ALIGN
        self.drain()
        slot = self._free_slot()
        segment = None if slot is None else self._segment(slot, offset)
        if slot is None or segment is None:
            return torch_way(batch)
        for leaf, (off, dtype, shape, is_numpy) in zip(leaves, metas, strict=True):
            region = segment.arena[off : off + leaf.nbytes]
            if is_numpy:
                np.copyto(region.numpy().view(dtype).reshape(shape), leaf)
            else:
                region.view(dtype).view(shape).copy_(leaf)
        self.ticket += 1
        self.busy[slot] = self.ticket
        arena = None if segment.confirmed else segment.arena
        skeleton = torch_way(skeleton)  # what stays in it goes torch's way
        return Packed(
            self.owner, self.worker, segment.key, arena, slot, self.ticket, skeleton, metas
        )


class Transport:
    """One set of slots per start of a loader's workers.

    Built in the main process before the workers start; the workers' copies write
    (``writer``), the main process reads (``unpack`` finds it by ``id``).  ``hold``:
    zero-copy batches per worker the loop may hold before later ones are copied out (0:
    always copy).
    """

    def __init__(self, num_workers: int, slots: int, hold: int = HOLD) -> None:
        self.id = int.from_bytes(os.urandom(8), "little") >> 1
        self.slots, self.hold = slots, hold
        pipes = [Pipe(duplex=False) for _ in range(num_workers)]
        self._free: list[Connection] | None = [r for r, _ in pipes]  # read by the workers
        self._release: list[Connection] | None = [w for _, w in pipes]  # main process
        self._segments: dict[tuple[int, int], tuple[int, torch.Tensor]] = {}
        self._writer: _Writer | None = None
        self._pid = os.getpid()
        self._lock = threading.Lock()
        #: slots freed by the loop, waiting to be sent: (worker, key, slot, ticket)
        self._pending: deque[tuple[int, int, int, int]] = deque()
        self._held = [0] * num_workers
        RECEIVERS.register(self)

    def __getstate__(self) -> dict[str, Any]:
        # the pipes travel only to workers being started (a copy made any other way,
        # e.g. a deepcopy of the loader, gets no slots: torch's hand-off)
        spawning = get_spawning_popen() is not None
        return {
            "id": self.id,
            "slots": self.slots,
            "hold": self.hold,
            "_free": self._free if spawning else None,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._writer = None

    def writer(self, worker: int) -> _Writer:
        """This worker process's writer (made on first use)."""
        if self._writer is None:
            free = self._free[worker] if self._free is not None else None
            most = self.slots + self.hold
            self._writer = _Writer(self.id, worker, self.slots, most, free)
        return self._writer

    def held(self, worker: int) -> int:
        """Zero-copy batches of ``worker`` the loop holds now (their slots in use)."""
        self.flush()
        return self._held[worker]

    def receive(self, item: Packed) -> Any:
        where = (item.worker, item.slot)
        known = self._segments.get(where)
        if item.arena is not None:
            arena = item.arena
            self._segments[where] = (item.key, arena)
        elif known is not None and known[0] == item.key:
            arena = known[1]
        else:
            raise RuntimeError(f"evenly: worker {item.worker}'s shared batch slots are unknown")
        self.flush()
        with self._lock:
            keep = self._held[item.worker] < self.hold
            if keep:
                self._held[item.worker] += 1
        if keep:
            free = (weakref.ref(self), item.worker, item.key, item.slot, item.ticket)
            return fill(item.skeleton, slot_views(arena, item.metas, _released, free))
        raw = arena.numpy()
        arrays: list[Any] = []
        for off, dtype, shape, is_numpy in item.metas:
            if is_numpy:
                n = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
                arrays.append(raw[off : off + n].view(dtype).reshape(shape).copy())
            else:
                # numpy's copy: one thread (torch's clone may wake its intra-op thread
                # pool, which then spins on a core the workers need)
                n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
                if n == 0:
                    arrays.append(torch.empty(shape, dtype=dtype))
                    continue
                copied = torch.from_numpy(raw[off : off + n].copy())
                arrays.append(copied.view(dtype).view(shape))
        self._send_free(item)
        return fill(item.skeleton, arrays)

    def _send_free(self, item: Packed) -> None:
        self._send(item.worker, item.key, item.slot, item.ticket)

    def _send(self, worker: int, key: int, slot: int, ticket: int) -> None:
        if self._release is None:
            return
        with contextlib.suppress(OSError):  # a worker that has exited frees nothing
            self._release[worker].send_bytes(_RELEASE.pack(key, slot, ticket))

    def flush(self) -> None:
        """Send the frees of the zero-copy batches the loop has let go of.  Called by the
        batches' finalizers (any thread, or the garbage collector in the middle of this
        very method: hence a lock that is only tried) and before each receive."""
        if os.getpid() != self._pid or not self._lock.acquire(blocking=False):
            return  # a forked child frees nothing; a flush under way sends these too
        try:
            while self._pending:
                worker, key, slot, ticket = self._pending.popleft()
                self._held[worker] -= 1
                self._send(worker, key, slot, ticket)
        finally:
            self._lock.release()

    def close(self) -> None:
        for conn in [*(self._release or []), *(self._free or [])]:
            conn.close()
        self._release = None
        self._segments.clear()


def _released(owner: weakref.ref[Transport], worker: int, key: int, slot: int, ticket: int) -> None:
    """A zero-copy batch's finalizer: its slot is free once the frees are flushed."""
    transport = owner()
    if transport is not None:
        transport._pending.append((worker, key, slot, ticket))
        transport.flush()
