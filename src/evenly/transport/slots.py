"""Batches from DataLoader workers to the main process through reusable shared memory.

Torch hands a batch over by moving each of its tensors into a new shared-memory segment
and sending the segment's file descriptor through a socket; the main process maps it,
and the segment is unmapped again once the batch is freed.  For a batch of a few
hundred KiB that is most of the cost of the hand-off (about 1 ms per batch on two cores,
against 0.1 ms for the same batch's gather).  Here each worker owns a few *slots* in one
shared-memory arena mapped once: it copies a batch's arrays into a free slot and sends
only a small description (the batch with each array replaced by a placeholder, plus
offsets, dtypes and shapes); the main process copies the arrays out into ordinary
memory, rebuilds the batch and tells the worker, through a pipe, that the slot is free.

Correctness does not rest on the slot count: a worker that finds no free slot (the
main process holds several of its batches waiting for their turn, or a batch was
dropped with an abandoned pass) hands that batch over the way torch does.  Every use of
a slot carries a ticket, so a late "free" message never frees a slot that was reused.

A packed batch names its transport by id only; the main process finds the transport in
its :data:`RECEIVERS` registry (see :class:`Receivers` for why that one is per process).
"""

from __future__ import annotations

import contextlib
import os
import struct
import threading
import weakref
from collections.abc import Callable, Sequence
from multiprocessing import Pipe
from multiprocessing.connection import Connection
from multiprocessing.context import get_spawning_popen
from typing import Any

import numpy as np
import torch

from evenly.runtime import torch_compat

__all__ = ["RECEIVERS", "Packed", "Receivers", "Transport", "plain_collate", "unpack"]

_ALIGN = 64
_RELEASE = struct.Struct("<qqq")  # arena key, slot, ticket


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


def _stack(batch: Sequence[torch.Tensor], *, collate_fn_map: Any = None) -> torch.Tensor:
    return torch.stack(list(batch), 0)


_PLAIN_MAP: dict[Any, Callable[..., Any]] = {
    **torch_compat.default_collate_fn_map(),
    torch.Tensor: _stack,
}


def plain_collate(batch: list[Any]) -> Any:
    """``default_collate``'s result, with tensors stacked in ordinary memory (in a worker,
    ``default_collate`` puts each stacked tensor in a new shared-memory segment, which
    the slots make unnecessary)."""
    return torch_compat.collate_with(batch, _PLAIN_MAP)


class _Leaf:
    """Where an array of the batch stood (the index of its entry in ``Packed.metas``)."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __reduce__(self) -> tuple[Any, tuple[int]]:
        return (_Leaf, (self.index,))


#: (offset in the slot, dtype, shape, is a numpy array)
_Meta = tuple[int, Any, tuple[int, ...], bool]


def _packable(x: Any) -> bool:
    if type(x) is torch.Tensor:
        return (
            x.device.type == "cpu"
            and x.layout == torch.strided
            and not x.is_nested  # a nested tensor has no single shape: torch's way
            and not x.requires_grad
            and not x.is_quantized
            # a tensor already in shared memory travels as its handle, without a copy
            and not x.is_shared()  # type: ignore[no-untyped-call]
            and x.is_contiguous()
        )
    return type(x) is np.ndarray and not x.dtype.hasobject and x.flags.c_contiguous


def _rebuild(x: Any, swap: Callable[[Any], Any]) -> Any:
    """``x`` with each part that ``swap`` replaces (returns something else for) replaced,
    looking inside dicts, lists, tuples and namedtuples."""
    new = swap(x)
    if new is not x:
        return new
    kind = type(x)
    if kind is dict:
        return {k: _rebuild(v, swap) for k, v in x.items()}
    if kind is list:
        return [_rebuild(v, swap) for v in x]
    if kind is tuple:
        return tuple(_rebuild(v, swap) for v in x)
    if isinstance(x, tuple) and hasattr(x, "_fields"):  # a namedtuple
        return kind(*(_rebuild(v, swap) for v in x))
    return x


def _strip(x: Any, leaves: list[Any]) -> Any:
    """``x`` with each packable array replaced by a ``_Leaf`` (appended to ``leaves``); an
    array that appears twice is one leaf, so it arrives as one array, as with pickle."""
    seen: dict[int, _Leaf] = {}

    def swap(v: Any) -> Any:
        if not _packable(v):
            return v
        leaf = seen.get(id(v))
        if leaf is None:
            leaves.append(v)
            leaf = seen[id(v)] = _Leaf(len(leaves) - 1)
        return leaf

    return _rebuild(x, swap)


def _torch_way(batch: Any) -> Any:
    """A batch that goes torch's way, its tensors moved into shared memory here, in the
    worker's own thread, before torch's queue pickles it: without room in /dev/shm that
    is an error of this batch, raised where the DataLoader passes it on (torch's queue
    feeder thread would print it and drop the batch, and the main process would wait
    for it forever)."""

    def share(v: Any) -> None:
        kind = type(v)
        if kind in (dict, list, tuple) or (isinstance(v, tuple) and hasattr(v, "_fields")):
            for part in v.values() if kind is dict else v:
                share(part)
            return
        plain = kind is torch.Tensor and v.device.type == "cpu"
        if plain and v.layout == torch.strided and not v.is_nested and not v.is_shared():  # type: ignore[no-untyped-call]
            try:
                v.share_memory_()  # type: ignore[no-untyped-call]
            except (RuntimeError, OSError) as exc:
                raise RuntimeError(
                    f"evenly: no room in shared memory (/dev/shm: {_shm_free() >> 20} MiB "
                    f"free) for a batch tensor of {v.nbytes >> 20} MiB that DataLoader "
                    f"workers hand over: give the machine (or container: --shm-size) more "
                    f"/dev/shm, use smaller batches, fewer workers or prefetch_factor"
                ) from exc

    share(batch)
    return batch


def _fill(x: Any, arrays: list[Any]) -> Any:
    """``x`` with each ``_Leaf`` replaced by its array."""
    return _rebuild(x, lambda v: arrays[v.index] if type(v) is _Leaf else v)


class Packed:
    """A batch whose arrays wait in a worker's slot (what crosses torch's queue)."""

    __slots__ = ("arena", "key", "metas", "owner", "size", "skeleton", "slot", "ticket", "worker")

    def __init__(
        self,
        owner: int,
        worker: int,
        key: int,
        arena: torch.Tensor | None,
        size: int,
        slot: int,
        ticket: int,
        skeleton: Any,
        metas: list[_Meta],
    ) -> None:
        self.owner, self.worker, self.key, self.arena = owner, worker, key, arena
        self.size, self.slot, self.ticket = size, slot, ticket
        self.skeleton, self.metas = skeleton, metas

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (Packed, (self.owner, self.worker, self.key, self.arena, self.size,
                         self.slot, self.ticket, self.skeleton, self.metas))  # fmt: skip

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


class _Writer:
    """A worker's side: its arena, which slots are in use (slot -> ticket)."""

    def __init__(self, owner: int, worker: int, slots: int, free: Connection | None) -> None:
        self.owner, self.worker, self.slots = owner, worker, slots
        self.key = 0
        self.arena: torch.Tensor | None = None
        self.size = 0
        self.busy: dict[int, int] = {}
        self.ticket = 0
        self.confirmed = False
        self.disabled = free is None
        self.free = free

    def drain(self) -> None:
        if self.free is None:
            return
        while self.free.poll():
            key, slot, ticket = _RELEASE.unpack(self.free.recv_bytes())
            if key == self.key:
                self.confirmed = True
                if self.busy.get(slot) == ticket:
                    del self.busy[slot]

    def reclaim(self) -> None:
        """At a pass start: batches of an earlier pass still unreleased were dropped."""
        self.drain()
        self.busy.clear()

    def _grow(self, need: int) -> bool:
        size = -(-need * 5 // 4 // 4096) * 4096
        if self.slots * size > _shm_free() // 2:  # leave /dev/shm room (a full one is a SIGBUS)
            self.disabled = True
            return False
        try:
            arena = torch.empty(self.slots * size, dtype=torch.uint8).share_memory_()  # type: ignore[no-untyped-call]
        except (RuntimeError, OSError):  # no room in /dev/shm: torch's way from now on
            self.disabled = True
            return False
        self.arena, self.size, self.busy, self.confirmed = arena, size, {}, False
        self.key = int.from_bytes(os.urandom(8), "little") >> 1
        return True

    def pack(self, batch: Any) -> Any:
        if self.disabled:
            return _torch_way(batch)
        leaves: list[Any] = []
        skeleton = _strip(batch, leaves)
        if not leaves:
            return _torch_way(batch)
        metas: list[_Meta] = []
        offset = 0
        for leaf in leaves:
            metas.append((offset, leaf.dtype, tuple(leaf.shape), type(leaf) is np.ndarray))
            offset += -(-int(leaf.nbytes) // _ALIGN) * _ALIGN
        if offset > self.size and not self._grow(offset):
            return _torch_way(batch)
        self.drain()
        slot = next((s for s in range(self.slots) if s not in self.busy), None)
        if slot is None:
            return _torch_way(batch)
        assert self.arena is not None
        base = slot * self.size
        for leaf, (off, dtype, shape, is_numpy) in zip(leaves, metas, strict=True):
            start = base + off
            region = self.arena[start : start + leaf.nbytes]
            if is_numpy:
                np.copyto(region.numpy().view(dtype).reshape(shape), leaf)
            else:
                region.view(dtype).view(shape).copy_(leaf)
        self.ticket += 1
        self.busy[slot] = self.ticket
        arena = None if self.confirmed else self.arena
        skeleton = _torch_way(skeleton)  # what stays in it goes torch's way
        return Packed(self.owner, self.worker, self.key, arena, self.size, slot,
                      self.ticket, skeleton, metas)  # fmt: skip


def _shm_free() -> int:
    """Bytes free in /dev/shm (where shared memory lives on Linux; unbounded elsewhere)."""
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return 1 << 62
    return st.f_bavail * st.f_frsize


class Transport:
    """One set of slots per start of a loader's workers.

    Built in the main process before the workers start; the workers' copies write
    (``writer``), the main process reads (``unpack`` finds it by ``id``).
    """

    def __init__(self, num_workers: int, slots: int) -> None:
        self.id = int.from_bytes(os.urandom(8), "little") >> 1
        self.slots = slots
        pipes = [Pipe(duplex=False) for _ in range(num_workers)]
        self._free: list[Connection] | None = [r for r, _ in pipes]  # read by the workers
        self._release: list[Connection] | None = [w for _, w in pipes]  # main process
        self._arenas: dict[int, tuple[int, torch.Tensor]] = {}  # worker -> (key, arena)
        self._writer: _Writer | None = None
        RECEIVERS.register(self)

    def __getstate__(self) -> dict[str, Any]:
        # the pipes travel only to workers being started (a copy made any other way,
        # e.g. a deepcopy of the loader, gets no slots: torch's hand-off)
        spawning = get_spawning_popen() is not None
        return {"id": self.id, "slots": self.slots, "_free": self._free if spawning else None,
                "_release": None, "_arenas": {}, "_writer": None}  # fmt: skip

    def writer(self, worker: int) -> _Writer:
        """This worker process's writer (made on first use)."""
        if self._writer is None:
            free = self._free[worker] if self._free is not None else None
            self._writer = _Writer(self.id, worker, self.slots, free)
        return self._writer

    def receive(self, item: Packed) -> Any:
        known = self._arenas.get(item.worker)
        if item.arena is not None:
            arena = item.arena
            self._arenas[item.worker] = (item.key, arena)
        elif known is not None and known[0] == item.key:
            arena = known[1]
        else:
            raise RuntimeError(f"evenly: worker {item.worker}'s shared batch slots are unknown")
        base = item.slot * item.size
        raw = arena.numpy()
        arrays: list[Any] = []
        for off, dtype, shape, is_numpy in item.metas:
            start = base + off
            if is_numpy:
                n = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
                arrays.append(raw[start : start + n].view(dtype).reshape(shape).copy())
            else:
                # numpy's copy: one thread (torch's clone may wake its intra-op thread
                # pool, which then spins on a core the workers need)
                n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
                if n == 0:
                    arrays.append(torch.empty(shape, dtype=dtype))
                    continue
                copied = torch.from_numpy(raw[start : start + n].copy())
                arrays.append(copied.view(dtype).view(shape))
        self._send_free(item)
        return _fill(item.skeleton, arrays)

    def _send_free(self, item: Packed) -> None:
        if self._release is None:
            return
        with contextlib.suppress(OSError):  # a worker that has exited frees nothing
            self._release[item.worker].send_bytes(_RELEASE.pack(item.key, item.slot, item.ticket))

    def close(self) -> None:
        for conn in [*(self._release or []), *(self._free or [])]:
            conn.close()
        self._release = None
        self._arenas.clear()
