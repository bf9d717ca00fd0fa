"""``best_fit``: documents are never split when they fit in a row; they are packed
best-fit-decreasing within windows of consecutive documents of the epoch's order.

Per window of ``window`` positions: a document longer than ``seq_len`` gives
``len // seq_len`` full rows of its own (the window's first rows, in position order) and
its remainder is packed like any other document.  The documents (remainders) are taken
run by run (runs of ``4 * open_rows`` consecutive positions of the window), longest first
within a run (ties: by position); each goes to the open row it fills best (the least
room left that still holds it; ties: the lowest slot).  If none holds it, a new row is
opened in a free slot among ``open_rows``, or, when all are taken, in the slot of the
fullest open row, which is closed.  The window's rows are numbered in the order they were
opened, after its full rows; a row's pieces in the order they were placed.

Every window is packed by the same steps, so all windows of a group are packed together
in lockstep, one numpy operation per step over ``(windows, open_rows)``: planning costs
``O(N * open_rows)`` element operations and no Python per document
(:func:`best_fit_chunks` yields the pieces of each group, sorted by row, rows numbered
across the epoch).  :class:`FittedRows` reads a plan back: row ``r``'s pieces through a
resume point every ``ROW_STRIDE`` rows and a binary search.

Pure numpy: no torch, no I/O.

>>> lengths = np.array([3, 2, 4, 1], dtype=np.int64)
>>> (chunk,) = best_fit_chunks(lambda p: lengths[p], 4, seq_len=4, window=4, open_rows=2)
>>> chunk.tolist()
[(0, 2, 0, 4), (1, 0, 0, 3), (1, 3, 0, 1), (2, 1, 0, 2)]
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import numpy.typing as npt

from evenly.core.packing.pieces import Lengths, pieces_of

__all__ = ["ROW_STRIDE", "FittedRows", "best_fit_chunks", "row_index"]

I64 = npt.NDArray[np.int64]
#: Rows between two resume points of a plan.
ROW_STRIDE = 1024
#: Document positions packed together (in lockstep) per group.
GROUP = 1 << 17
#: Documents sorted longest first together: runs of ``SORT_RUN * open_rows`` positions.
SORT_RUN = 4


def best_fit_chunks(
    lengths_at: Lengths,
    num_docs: int,
    *,
    seq_len: int,
    window: int,
    open_rows: int,
    group: int = GROUP,
) -> Iterator[npt.NDArray[np.void]]:
    """The epoch's pieces, one sorted chunk per group of windows (see the module)."""
    group = max(window, group - group % window)
    row_base = 0
    for lo in range(0, num_docs, group):
        hi = min(lo + group, num_docs)
        lengths = np.asarray(lengths_at(np.arange(lo, hi, dtype=np.int64)), dtype=np.int64)
        chunk = _pack_group(lengths, lo, row_base, seq_len, window, open_rows)
        if chunk.size:
            row_base = int(chunk["row"][-1]) + 1
            yield chunk


def _pack_group(
    lengths: I64, base: int, row_base: int, seq_len: int, window: int, open_rows: int
) -> npt.NDArray[np.void]:
    count = lengths.size
    windows = -(-count // window)
    size = windows * window
    full = lengths // seq_len
    rem = np.zeros(size, dtype=np.int64)
    rem[:count] = lengths - full * seq_len
    rem2 = rem.reshape(windows, window)
    # longest first within each run of SORT_RUN * open_rows positions of a window
    run = np.arange(window, dtype=np.int64) // (SORT_RUN * open_rows)
    order = np.argsort(run * (seq_len + 1) - rem2, axis=1, kind="stable")
    items = np.take_along_axis(rem2, order, axis=1)
    item_row = _lockstep(items, seq_len, open_rows)
    # full rows first (in position order), then the window's packed rows
    full_pad = np.zeros(size, dtype=np.int64)
    full_pad[:count] = full
    full_per_window = full_pad.reshape(windows, window).sum(axis=1)
    packed_per_window = item_row.max(axis=1, initial=-1) + 1
    window_rows = full_per_window + packed_per_window
    window_base = row_base + np.concatenate([[0], np.cumsum(window_rows)[:-1]])
    # the full pieces
    doc = np.repeat(np.arange(count, dtype=np.int64), full)
    first_full = np.concatenate([[0], np.cumsum(full)[:-1]])
    k = np.arange(doc.size, dtype=np.int64) - np.repeat(first_full, full)
    within = np.arange(doc.size, dtype=np.int64) - np.repeat(
        np.concatenate([[0], np.cumsum(full_per_window)[:-1]]), full_per_window
    )
    full_rows = window_base[doc // window] + within
    # the packed pieces
    placed = item_row >= 0
    w_idx, j_idx = np.nonzero(placed)
    src = w_idx * window + order[w_idx, j_idx]
    packed_rows = window_base[w_idx] + full_per_window[w_idx] + item_row[w_idx, j_idx]
    rows = np.concatenate([full_rows, packed_rows])
    pos = np.concatenate([doc, src]) + base
    start = np.concatenate([k * seq_len, full[src] * seq_len])
    length = np.concatenate([np.full(doc.size, seq_len, dtype=np.int64), rem[src]])
    by = np.argsort(rows, kind="stable")  # packed pieces come in (window, step) order
    return pieces_of(rows[by], pos[by], start[by], length[by])


def _lockstep(items: I64, seq_len: int, open_rows: int) -> I64:
    """Row (in opening order) of each item of each window; -1 for empty items.  ``items``
    is ``(windows, window)``, each window in packing order.

    The slots are ``(open_rows, windows)`` (one window per column, so every reduction runs
    across contiguous rows), and a slot's room and number are one key,
    ``room * open_rows + slot``: its minimum is the best fit, lowest slot first."""
    windows, width = items.shape
    k = np.int64(open_rows)
    item_row = np.full((windows, width), -1, dtype=np.int64)
    room = np.full((open_rows, windows), -1, dtype=np.int64)  # -1: a free slot
    slot_row = np.zeros((open_rows, windows), dtype=np.int64)
    opened = np.zeros(windows, dtype=np.int64)
    slots = np.arange(open_rows, dtype=np.int64)[:, None]
    columns = np.arange(windows, dtype=np.int64)
    never = np.int64(seq_len + 1) * k
    for j in range(width):
        n = items[:, j]
        live = n > 0
        if not live.any():
            continue
        key = room * k + slots
        best = np.where(room >= n, key, never).min(axis=0)
        fits = (best < never) | ~live
        # no fit: the lowest free slot, else the fullest open row's (closed)
        fresh = np.where(room < 0, slots - k, key).min(axis=0)
        fresh = np.where(fresh < 0, fresh + k, fresh % k)
        slot = np.where(fits, best % k, fresh)
        new = np.flatnonzero(~fits)
        slot_row[slot[new], new] = opened[new]
        opened[new] += 1
        room[slot[new], new] = seq_len
        room[slot, columns] -= n
        item_row[:, j] = np.where(live, slot_row[slot, columns], -1)
    return item_row


def row_index(rows: I64, num_rows: int, stride: int = ROW_STRIDE) -> I64:
    """Resume points of a plan's sorted row column: entry ``k`` is the first piece of row
    ``k * stride`` (the last entry: the piece count)."""
    marks = np.arange(0, num_rows, stride, dtype=np.int64)
    return np.concatenate([np.searchsorted(rows, marks), [rows.size]]).astype(np.int64)


class FittedRows:
    """An epoch's rows read back from its pieces (a memory-mapped plan file)."""

    def __init__(
        self,
        pieces: npt.NDArray[np.void],
        index: I64,
        num_rows: int,
        stride: int = ROW_STRIDE,
    ) -> None:
        self._pieces = pieces
        self._rows = pieces["row"]
        self._index = index
        self._num_rows = num_rows
        self.stride = stride

    @property
    def num_rows(self) -> int:
        return self._num_rows

    def pieces(self, rows: I64) -> npt.NDArray[np.void]:
        wanted = np.asarray(rows, dtype=np.int64)
        if wanted.size and (int(wanted.min()) < 0 or int(wanted.max()) >= self._num_rows):
            raise IndexError(f"rows must lie in [0, {self._num_rows}), got {wanted.tolist()}")
        parts = []
        for r in wanted.tolist():
            k = r // self.stride
            lo, hi = int(self._index[k]), int(self._index[k + 1])
            span = self._rows[lo:hi]
            a = lo + int(np.searchsorted(span, r, side="left"))
            b = lo + int(np.searchsorted(span, r, side="right"))
            parts.append(np.asarray(self._pieces[a:b]))
        if not parts:
            return pieces_of([], [], [], [])
        return np.concatenate(parts)
