"""Zero-copy batches: tensors and arrays that view a worker's slot, and a finalizer that
frees the slot once the last of them is gone.

All the arrays of one batch are views of one numpy array whose base is a small
:class:`_SlotHold` object (numpy makes every view of a view point at the first base
that is not an array that views another, so every slice, reshape or ``torch.from_numpy``
of them keeps that one object alive: a tensor's storage holds its numpy array).  A
``weakref.finalize`` on the hold runs when nothing views the slot any more, in whichever
thread drops the last reference; it only queues the free (see ``Transport.flush``).

>>> import torch
>>> arena = torch.arange(8, dtype=torch.uint8)
>>> freed = []
>>> (x,) = slot_views(arena, [(0, torch.uint8, (2, 2), False)], freed.append, ("slot 0",))
>>> x.tolist(), freed
([[0, 1], [2, 3]], [])
>>> y = x[1]; del x
>>> freed
[]
>>> del y; freed
['slot 0']
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from evenly.transport.tree import Meta

__all__ = ["slot_views"]


class _SlotHold:
    """Keeps a slot's segment mapped for the arrays that view it (their numpy base)."""

    __slots__ = ("__array_interface__", "__weakref__", "arena")

    def __init__(self, arena: torch.Tensor) -> None:
        self.arena = arena  # the segment stays mapped while anything views it
        self.__array_interface__ = {
            "version": 3,
            "shape": (arena.numel(),),
            "typestr": "|u1",
            "data": (arena.data_ptr(), False),
        }


def slot_views(
    arena: torch.Tensor,
    metas: list[Meta],
    finalizer: Callable[..., None],
    args: tuple[Any, ...],
) -> list[Any]:
    """The arrays ``metas`` describe, as views of ``arena``; ``finalizer(*args)`` runs
    once when none of them (nor any view of them) is referenced any more."""
    hold = _SlotHold(arena)
    raw = np.asarray(hold)
    out: list[Any] = []
    for off, dtype, shape, is_numpy in metas:
        if is_numpy:
            n = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
            out.append(raw[off : off + n].view(dtype).reshape(shape))
            continue
        n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if n == 0:
            out.append(torch.empty(shape, dtype=dtype))
            continue
        out.append(torch.from_numpy(raw[off : off + n]).view(dtype).view(shape))
    done = weakref.finalize(hold, finalizer, *args)
    done.atexit = False
    del hold, raw  # from here on only the views hold the slot
    return out
