"""Recycled output buffers: the arrays a reader hands to the loop (a columnar group's
columns, a group of packed rows) are views of pooled memory that goes back to its pool
once nothing views it any more, so a steady stream of large reads faults in no fresh
pages (a 16 MiB read in fresh memory costs 4096 page faults).

Every array :meth:`BufferPool.empty` returns is a view of one buffer whose numpy base is
a small hold object (numpy makes every view of a view point at that base, and a tensor
made by ``torch.from_numpy`` keeps its array alive), so the buffer is reused only when
the last array, slice or tensor over it is gone; a ``weakref.finalize`` on the hold puts
it back, in whichever thread drops that reference.  Nothing relies on the GIL: the free
list is a ``deque`` (its appends and pops are atomic).

>>> pool = BufferPool()
>>> a = pool.empty((2, 3), np.int64)
>>> a[:] = 7
>>> view = a[1]; address = a.ctypes.data; del a
>>> b = pool.empty((2, 3), np.int64)
>>> b.ctypes.data == address  # the first is still viewed: a new buffer
False
>>> del view
>>> pool.empty((2, 3), np.int64).ctypes.data == address  # given back: reused
True
"""

from __future__ import annotations

import weakref
from collections import deque
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["BufferPool"]


class _Hold:
    """The numpy base of one pooled buffer's arrays."""

    __slots__ = ("__array_interface__", "__weakref__", "buffer")

    def __init__(self, buffer: npt.NDArray[np.uint8]) -> None:
        self.buffer = buffer
        self.__array_interface__ = {
            "version": 3,
            "shape": (buffer.size,),
            "typestr": "|u1",
            "data": (buffer.ctypes.data, False),
        }


class BufferPool:
    """Buffers for one reader's outputs; ``keep``: free buffers kept for reuse (the rest
    are freed)."""

    def __init__(self, keep: int = 4) -> None:
        self.keep = keep
        self._free: deque[npt.NDArray[np.uint8]] = deque()

    def empty(self, shape: tuple[int, ...], dtype: Any) -> npt.NDArray[Any]:
        """An uninitialised array of ``shape`` and ``dtype`` in a pooled buffer."""
        dtype = np.dtype(dtype)
        size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        buffer = self._take(size)
        hold = _Hold(buffer)
        weakref.finalize(hold, self._give_back, buffer)
        array: npt.NDArray[Any] = np.asarray(hold)[:size].view(dtype).reshape(shape)
        return array

    def _take(self, size: int) -> npt.NDArray[np.uint8]:
        for _ in range(len(self._free)):
            try:
                candidate = self._free.popleft()
            except IndexError:  # taken meanwhile by another reader of the same pool
                break
            if candidate.size >= size:
                return candidate
            # too small for this read: dropped (reads of one kind have one size, but
            # the first reads of a pass and its last are smaller)
        return np.empty(max(size, 1), dtype=np.uint8)

    def _give_back(self, buffer: npt.NDArray[np.uint8]) -> None:
        if len(self._free) < self.keep:
            self._free.append(buffer)
