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

from evenly.core.packing.pieces import Lengths, pieces_of

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

    @property
    def num_rows(self) -> int:
        return -(-self.total // self.seq_len)

    def _block(self, k: int) -> I64:
        """Token offsets of block ``k``'s documents: entry ``i`` is the first token of
        position ``k * stride + i``, the last entry the block's end."""
        block = self._blocks.get(k)
        if block is None:
            lo, hi = k * self.stride, min((k + 1) * self.stride, self.num_docs)
            lengths = np.asarray(self.lengths_at(np.arange(lo, hi, dtype=np.int64)), np.int64)
            block = np.empty(hi - lo + 1, dtype=np.int64)
            block[0] = self.cum[k]
            np.cumsum(lengths, out=block[1:])
            block[1:] += self.cum[k]
            if len(self._blocks) >= 8:
                self._blocks.clear()
            self._blocks[k] = block
        return block

    def pieces(self, rows: I64) -> npt.NDArray[np.void]:
        """The pieces of the given rows (see :mod:`evenly.core.packing.pieces`), sorted
        by row then position: vectorised over the documents of the rows' token span
        (a batch's rows are consecutive), row by row for scattered rows."""
        r = np.asarray(rows, dtype=np.int64)
        if r.size and (int(r.min()) < 0 or int(r.max()) >= self.num_rows):
            bad = int(r[(r < 0) | (r >= self.num_rows)][0])
            raise IndexError(f"row must lie in [0, {self.num_rows}), got {bad}")
        if r.size and int(r.max()) - int(r.min()) < 2 * r.size:
            return self._span_pieces(np.unique(r))
        return self._row_pieces(r)

    def _span_pieces(self, rows: I64) -> npt.NDArray[np.void]:
        L = self.seq_len
        t0, t1 = int(rows[0]) * L, min((int(rows[-1]) + 1) * L, self.total)
        k0 = int(np.searchsorted(self.cum, t0, side="right")) - 1
        k1 = int(np.searchsorted(self.cum, t1 - 1, side="right")) - 1
        blocks = [self._block(k) for k in range(k0, k1 + 1)]
        first = np.concatenate([b[:-1] for b in blocks])
        last = np.concatenate([b[1:] for b in blocks])
        pos = np.arange(k0 * self.stride, k0 * self.stride + first.size, dtype=np.int64)
        keep = (first < t1) & (last > t0) & (last > first)
        first, last, pos = first[keep], last[keep], pos[keep]
        lo_row, hi_row = first // L, (last - 1) // L  # the rows each document touches
        count = hi_row - lo_row + 1
        doc = np.repeat(np.arange(pos.size), count)
        row = np.repeat(lo_row, count) + (
            np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count)
        )
        begin = np.maximum(first[doc], row * L)
        end = np.minimum(np.minimum(last[doc], (row + 1) * L), self.total)
        if int(rows[-1]) - int(rows[0]) + 1 == rows.size:  # consecutive rows (a batch)
            wanted = (row >= rows[0]) & (row <= rows[-1])
        else:
            wanted = np.isin(row, rows)
        row, doc, begin, end = row[wanted], doc[wanted], begin[wanted], end[wanted]
        # already sorted by (row, pos): documents follow each other in the token stream,
        # so a document's last row is at most the next one's first
        return pieces_of(row, pos[doc], begin - first[doc], end - begin)

    def _row_pieces(self, rows: I64) -> npt.NDArray[np.void]:
        out_row: list[I64] = []
        out_pos: list[I64] = []
        out_start: list[I64] = []
        out_len: list[I64] = []
        for r in np.asarray(rows, dtype=np.int64).tolist():
            if not 0 <= r < self.num_rows:
                raise IndexError(f"row must lie in [0, {self.num_rows}), got {r}")
            t0, t1 = r * self.seq_len, min((r + 1) * self.seq_len, self.total)
            k = int(np.searchsorted(self.cum, t0, side="right")) - 1
            while True:
                offsets = self._block(k)
                first, last = offsets[:-1], offsets[1:]
                hit = np.flatnonzero((first < t1) & (last > t0) & (last > first))
                if hit.size:
                    start = np.maximum(t0 - first[hit], 0)
                    end = np.minimum(t1, last[hit]) - first[hit]
                    out_row.append(np.full(hit.size, r, dtype=np.int64))
                    out_pos.append(hit + k * self.stride)
                    out_start.append(start)
                    out_len.append(end - start)
                if int(offsets[-1]) >= t1:
                    break
                k += 1
        if not out_row:
            return pieces_of([], [], [], [])
        return pieces_of(
            np.concatenate(out_row),
            np.concatenate(out_pos),
            np.concatenate(out_start),
            np.concatenate(out_len),
        )
