"""An epoch's document order evaluated a block of positions at a time (pure numpy).

Packing reads a batch's few dozen documents at consecutive positions of the epoch's
order; evaluating a keyed permutation (several vectorised rounds) for each small batch
costs more than the read.  :class:`BlockOrder` evaluates whole blocks of ``BLOCK``
positions and keeps the last few, so a worker evaluates each block once.  Requests of
many blocks (planning a whole epoch) go to the order directly.

>>> order = BlockOrder(lambda p: (np.asarray(p) * 7) % 10, 10, block=4)
>>> order(np.array([1, 2, 9])).tolist()
[7, 4, 3]
>>> sorted(order._blocks)
[0, 2]
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from evenly.core.locks import ForkSafeLock
from evenly.core.packing.pieces import distinct

__all__ = ["BLOCK", "BlockOrder"]

I64 = npt.NDArray[np.int64]
#: Positions evaluated together: a keyed permutation's cycle walking costs a few dozen
#: numpy calls per evaluation whatever its size, so blocks of a few read groups' documents
#: (64 KiB of indices each) make it a small part of a read.
BLOCK = 8192


class BlockOrder:
    """``order`` (position -> document index) over ``n`` positions, block by block."""

    def __init__(
        self, order: Callable[[Any], Any], n: int, *, block: int = BLOCK, keep: int = 8
    ) -> None:
        self.order, self.n, self.block, self.keep = order, int(n), int(block), int(keep)
        self._blocks: OrderedDict[int, I64] = OrderedDict()
        self._lock = ForkSafeLock()  # reader threads share it; no reliance on the GIL

    def __getstate__(self) -> dict[str, Any]:
        return {"order": self.order, "n": self.n, "block": self.block, "keep": self.keep}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["order"], state["n"], block=state["block"], keep=state["keep"])  # type: ignore[misc]

    def __call__(self, positions: Any) -> I64:
        p = np.asarray(positions, dtype=np.int64)
        if p.size > self.block * self.keep // 2:
            return np.asarray(self.order(p), dtype=np.int64)
        flat = p.reshape(-1)
        blocks = flat // self.block
        out = np.empty_like(flat)
        for b in distinct(blocks)[0].tolist():  # no sort where positions come in order
            values = self._get(b)
            sel = blocks == b
            out[sel] = values[flat[sel] - b * self.block]
        return out.reshape(p.shape)

    def _get(self, b: int) -> I64:
        with self._lock:
            values = self._blocks.get(b)
            if values is not None:
                self._blocks.move_to_end(b)
                return values
        lo, hi = b * self.block, min((b + 1) * self.block, self.n)
        values = np.asarray(self.order(np.arange(lo, hi, dtype=np.int64)), dtype=np.int64)
        with self._lock:
            self._blocks[b] = values
            while len(self._blocks) > self.keep:
                self._blocks.popitem(last=False)
        return values
