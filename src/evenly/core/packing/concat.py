"""``concat``: the epoch's token stream (its documents in the epoch's order, one after
the other) cut into rows of ``seq_len`` tokens; a document may continue in the next row,
and only the epoch's last row is short (padded).

The plan is one resume point every ``STRIDE`` document positions: the tokens before it
(:func:`concat_checkpoints`, one pass over the epoch's lengths, ``N / STRIDE`` int64).
Row ``r`` starts at token ``r * seq_len``: a binary search over the resume points and
the lengths of at most a few blocks of ``STRIDE`` documents locate it, with no replay.

Pure numpy: no torch, no I/O.

>>> lengths = np.array([3, 2, 4], dtype=np.int64)
>>> cum = concat_checkpoints(lambda p: lengths[p], 3, stride=2)
>>> cum.tolist()
[0, 5, 9]
>>> rows = ConcatRows(cum, lambda p: lengths[p], 3, seq_len=4, stride=2)
>>> rows.num_rows, rows.pieces(np.array([0, 1, 2])).tolist()
(3, [(0, 0, 0, 3), (0, 1, 0, 1), (1, 1, 1, 1), (1, 2, 0, 3), (2, 2, 3, 1)])
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from evenly.core.locks import ForkSafeLock
from evenly.core.packing.pieces import Lengths, distinct, pieces_of

__all__ = ["STRIDE", "ConcatRows", "concat_checkpoints"]

I64 = npt.NDArray[np.int64]
#: Document positions between two resume points.
STRIDE = 1024
#: Document positions whose lengths are gathered per numpy call while planning.
CHUNK = 1 << 18


def concat_checkpoints(
    lengths_at: Lengths, num_docs: int, *, stride: int = STRIDE, chunk: int = CHUNK
) -> I64:
    """``cum[k]``: the tokens of positions ``[0, k * stride)``; the last entry is the
    epoch's total (``ceil(num_docs / stride) + 1`` entries)."""
    blocks = -(-num_docs // stride)
    cum = np.zeros(blocks + 1, dtype=np.int64)
    chunk = max(stride, chunk - chunk % stride)
    for lo in range(0, num_docs, chunk):
        hi = min(lo + chunk, num_docs)
        lengths = np.asarray(lengths_at(np.arange(lo, hi, dtype=np.int64)), dtype=np.int64)
        sums = np.add.reduceat(lengths, np.arange(0, hi - lo, stride))
        cum[lo // stride + 1 : lo // stride + 1 + sums.size] = sums
    np.cumsum(cum, out=cum)
    return cum


class ConcatRows:
    """The rows of one epoch under ``concat`` (see the module)."""

    def __init__(
        self, cum: I64, lengths_at: Lengths, num_docs: int, *, seq_len: int, stride: int = STRIDE
    ) -> None:
        self.cum = cum
        self.lengths_at = lengths_at
        self.num_docs = num_docs
        self.seq_len = seq_len
        self.stride = stride
        self.total = int(cum[-1]) if cum.size else 0
        self._blocks: dict[int, I64] = {}
        self._lock = ForkSafeLock()  # reader threads share it; no reliance on the GIL

    @property
    def num_rows(self) -> int:
        return -(-self.total // self.seq_len)

    def _block(self, k: int) -> I64:
        """Token offsets of block ``k``'s documents: entry ``i`` is the first token of
        position ``k * stride + i``, the last entry the block's end."""
        with self._lock:
            block = self._blocks.get(k)
        if block is None:
            lo, hi = k * self.stride, min((k + 1) * self.stride, self.num_docs)
            lengths = np.asarray(self.lengths_at(np.arange(lo, hi, dtype=np.int64)), np.int64)
            block = np.empty(hi - lo + 1, dtype=np.int64)
            block[0] = self.cum[k]
            np.cumsum(lengths, out=block[1:])
            block[1:] += self.cum[k]
            with self._lock:
                if len(self._blocks) >= 8:
                    self._blocks.clear()
                self._blocks[k] = block
        return block

    def pieces(self, rows: I64) -> npt.NDArray[np.void]:
        """The pieces of the given rows (see :mod:`evenly.core.packing.pieces`), sorted
        by row then position: vectorised over the rows and the documents of the blocks
        their tokens fall in (any set of rows: a batch, or a worker's scattered ones)."""
        r = distinct(rows)[0]
        if r.size and (int(r[0]) < 0 or int(r[-1]) >= self.num_rows):
            bad = int(r[(r < 0) | (r >= self.num_rows)][0])
            raise IndexError(f"row must lie in [0, {self.num_rows}), got {bad}")
        if not r.size:
            return pieces_of([], [], [], [])
        L = self.seq_len
        t0, t1 = r * L, np.minimum((r + 1) * L, self.total)  # each row's token span
        k0 = np.searchsorted(self.cum, t0, side="right") - 1
        k1 = np.searchsorted(self.cum, t1 - 1, side="right") - 1
        blocks = distinct(_ranges(k0, k1 - k0 + 1))[0].tolist()
        offsets = [self._block(k) for k in blocks]
        first = np.concatenate([b[:-1] for b in offsets])  # each document's first token
        last = np.concatenate([b[1:] for b in offsets])  # ... and its end
        pos = _ranges(
            np.asarray(blocks, dtype=np.int64) * self.stride, [b.size - 1 for b in offsets]
        )
        # the documents of each row: those ending after its start, starting before its end
        d0 = np.searchsorted(last, t0, side="right")
        d1 = np.searchsorted(first, t1, side="left")
        count = d1 - d0
        doc = _ranges(d0, count)
        row = np.repeat(r, count)
        begin = np.maximum(first[doc], row * L)
        end = np.minimum(last[doc], np.repeat(t1, count))
        keep = end > begin  # empty documents hold no piece
        row, doc, begin, end = row[keep], doc[keep], begin[keep], end[keep]
        return pieces_of(row, pos[doc], begin - first[doc], end - begin)


def _ranges(starts: npt.ArrayLike, counts: npt.ArrayLike) -> I64:
    """``starts[i], starts[i] + 1, ...`` (``counts[i]`` values) for each ``i``, in order."""
    lo, n = np.asarray(starts, dtype=np.int64), np.asarray(counts, dtype=np.int64)
    total = int(n.sum())
    return np.repeat(lo - (np.cumsum(n) - n), n) + np.arange(total, dtype=np.int64)
