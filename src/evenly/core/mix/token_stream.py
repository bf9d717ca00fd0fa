"""One source's token stream for a mixture by tokens (numpy only: no torch, no I/O).

The stream is the source's passes one after the other (pass ``k``: a keyed permutation of
its documents, the identity without shuffle), each document cut into pieces of at most
``seq_len`` tokens at multiples of ``seq_len`` from its start.  :meth:`TokenStream.items`
gives the pieces that overlap any token range, clipped to another (the epoch's edges),
in stream order, with memory in the size of the range: a pass is located through resume
points every ``STRIDE`` positions (its tokens before them), computed once per pass in
chunks, so no array of a pass's length is ever built.

>>> stream = TokenStream(np.array([3, 5, 2]), seq_len=4, key=0, shuffle=False)
>>> [tuple(int(v) for v in col) for col in stream.items(2, 9, 0, 10)]  # doc, start, len, s
[(0, 1, 1, 2), (0, 0, 4, 0), (3, 4, 1, 2), (0, 3, 7, 8)]
>>> [tuple(int(v) for v in col) for col in stream.items(2, 9, 4, 9)]  # clipped
[(1, 1, 2), (1, 4, 0), (3, 1, 1), (4, 7, 8)]
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from evenly.core.permutation import keyed_bijection, mix64

__all__ = ["ITEM", "STRIDE", "TokenStream"]

I64 = npt.NDArray[np.int64]
#: One item of a mixture's epoch order: tokens ``[start, start + len)`` of global
#: document ``doc`` (16 bytes, the layout of the node's plan file too).
ITEM = np.dtype([("doc", "<i8"), ("start", "<i4"), ("len", "<i4")])
#: Positions of a pass between two resume points.
STRIDE = 1024
#: Positions whose lengths are gathered per numpy call while finding resume points.
_CHUNK = 1 << 16
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


class TokenStream:
    """The token stream of one source (``lengths``: tokens per document, any int array,
    e.g. a memory map)."""

    def __init__(self, lengths: Any, *, seq_len: int, key: int, shuffle: bool) -> None:
        self.lengths = lengths
        self.n = len(lengths)
        self.seq_len, self.key, self.shuffle = int(seq_len), int(key), bool(shuffle)
        self.total = 0
        self.pieces = 0
        for lo in range(0, self.n, _CHUNK):
            chunk = np.asarray(lengths[lo : lo + _CHUNK], dtype=np.int64)
            self.total += int(chunk.sum())
            self.pieces += int(((chunk + self.seq_len - 1) // self.seq_len).sum())
        self._marks: dict[int, I64] = {}

    def docs(self, k: int, positions: I64) -> I64:
        """The documents at ``positions`` of pass ``k``."""
        if not self.shuffle or self.n < 2:
            return positions
        pass_key = np.array([self.key], np.uint64) ^ mix64(np.array([k], np.uint64) * _GOLDEN)
        keys = np.full(positions.size, mix64(pass_key)[0], dtype=np.uint64)
        return keyed_bijection(positions, np.full(positions.size, self.n, np.int64), keys)

    def marks(self, k: int) -> I64:
        """Pass ``k``'s tokens before positions ``0, STRIDE, 2 * STRIDE, ...`` (and the
        pass's total last)."""
        found = self._marks.get(k)
        if found is None:
            found = np.zeros(-(-self.n // STRIDE) + 1, dtype=np.int64)
            for lo in range(0, self.n, _CHUNK):
                pos = np.arange(lo, min(lo + _CHUNK, self.n), dtype=np.int64)
                lens = np.asarray(self.lengths[self.docs(k, pos)], dtype=np.int64)
                sums = np.add.reduceat(lens, np.arange(0, pos.size, STRIDE))
                found[lo // STRIDE + 1 : lo // STRIDE + 1 + sums.size] = sums
            np.cumsum(found, out=found)
            if len(self._marks) >= 2:
                self._marks.pop(next(iter(self._marks)))
            self._marks[k] = found
        return found

    def items(self, lo: int, hi: int, clip_lo: int, clip_hi: int) -> tuple[I64, I64, I64, I64]:
        """``(doc, start, len, s)`` of the pieces that overlap stream tokens ``[lo, hi)``,
        each clipped to ``[clip_lo, clip_hi)`` (``s``: the stream token it starts at)."""
        parts: list[tuple[I64, I64, I64, I64]] = []
        if hi > lo and self.total:
            for k in range(lo // self.total, (hi - 1) // self.total + 1):
                parts.append(self._pass_items(k, lo, hi, clip_lo, clip_hi))
        if not parts:
            empty = np.zeros(0, dtype=np.int64)
            return empty, empty, empty, empty
        return tuple(np.concatenate([p[i] for p in parts]) for i in range(4))  # type: ignore[return-value]

    def _pass_items(
        self, k: int, lo: int, hi: int, clip_lo: int, clip_hi: int
    ) -> tuple[I64, I64, I64, I64]:
        base, seq_len = k * self.total, self.seq_len
        a, b = max(lo, base) - base, min(hi, base + self.total) - base
        ca, cb = max(clip_lo, base) - base, min(clip_hi, base + self.total) - base
        marks = self.marks(k)
        first = int(np.searchsorted(marks, a, side="right")) - 1
        last = int(np.searchsorted(marks, b, side="left")) - 1
        pos = np.arange(first * STRIDE, min((max(last, first) + 1) * STRIDE, self.n))
        docs = self.docs(k, pos)
        lens = np.asarray(self.lengths[docs], dtype=np.int64)
        ends = np.cumsum(lens) + marks[first]
        starts = ends - lens
        sel = (ends > starts) & (starts < b) & (ends > a) & (starts < cb) & (ends > ca)
        d, st, en = docs[sel], starts[sel], ends[sel]
        # pieces of each document (cut at multiples of seq_len from its start) that
        # overlap [a, b), then clipped to [ca, cb)
        p_lo = (np.maximum(st, a) - st) // seq_len
        p_hi = (np.minimum(en, b) - st - 1) // seq_len
        count = p_hi - p_lo + 1
        seg = np.repeat(np.arange(d.size), count)
        piece = p_lo[seg] + np.arange(seg.size) - np.repeat(np.cumsum(count) - count, count)
        s = np.maximum(st[seg] + piece * seq_len, ca)
        e = np.minimum(np.minimum(st[seg] + (piece + 1) * seq_len, en[seg]), cb)
        keep = e > s  # a piece outside the clip range
        seg, s, e = seg[keep], s[keep], e[keep]
        return d[seg], s - st[seg], e - s, s + base
