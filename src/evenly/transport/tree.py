"""The batch as a tree: what of it can travel through a slot (plain CPU tensors and
numpy arrays), the batch with those leaves taken out and put back, and the rest handed
over torch's way (moved into shared memory in the worker's own thread)."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from evenly.runtime import torch_compat

__all__ = ["Leaf", "Meta", "fill", "packable", "plain_collate", "shm_free", "strip", "torch_way"]


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


class Leaf:
    """Where an array of the batch stood (the index of its entry in ``Packed.metas``)."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __reduce__(self) -> tuple[Any, tuple[int]]:
        return (Leaf, (self.index,))


#: (offset in the slot, dtype, shape, is a numpy array)
Meta = tuple[int, Any, tuple[int, ...], bool]


def packable(x: Any) -> bool:
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


def strip(x: Any, leaves: list[Any]) -> Any:
    """``x`` with each packable array replaced by a ``Leaf`` (appended to ``leaves``); an
    array that appears twice is one leaf, so it arrives as one array, as with pickle."""
    seen: dict[int, Leaf] = {}

    def swap(v: Any) -> Any:
        if not packable(v):
            return v
        leaf = seen.get(id(v))
        if leaf is None:
            leaves.append(v)
            leaf = seen[id(v)] = Leaf(len(leaves) - 1)
        return leaf

    return _rebuild(x, swap)


def torch_way(batch: Any) -> Any:
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
                    f"evenly: no room in shared memory (/dev/shm: {shm_free() >> 20} MiB "
                    f"free) for a batch tensor of {v.nbytes >> 20} MiB that DataLoader "
                    f"workers hand over: give the machine (or container: --shm-size) more "
                    f"/dev/shm, use smaller batches, fewer workers or prefetch_factor"
                ) from exc

    share(batch)
    return batch


def fill(x: Any, arrays: list[Any]) -> Any:
    """``x`` with each ``Leaf`` replaced by its array."""
    return _rebuild(x, lambda v: arrays[v.index] if type(v) is Leaf else v)


def shm_free() -> int:
    """Bytes free in /dev/shm (where shared memory lives on Linux; unbounded elsewhere)."""
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return 1 << 62
    return st.f_bavail * st.f_frsize
