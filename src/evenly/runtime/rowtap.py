"""What a batch of packed rows holds, for whoever watches the reads (the audit).

Under ``pack=`` the reader's sample tap (``Planner.tap``) does not see documents one by
one: a row is pieces of documents.  ``Planner.rows_tap`` (``None``: no one watches, the
only cost is that check) is called in the process that built the rows, once per batch,
with the rows and a :class:`RowPieces`: numpy columns, one entry per row and one per
piece, never one per token.

>>> import numpy as np
>>> from evenly.core.packing.pieces import pieces_of
>>> pieces = pieces_of([4, 4], [7, 8], [2, 0], [3, 5])
>>> found = (pieces, np.array([7, 8]), np.array([70, 80]), pieces["start"])
>>> part = tap_part(0, np.array([0, 1]), np.array([4, 9]), 5, found)
>>> seen = RowPieces.join([part], 2)
>>> seen.row.tolist(), seen.pad.tolist(), seen.doc.tolist(), seen.piece_row.tolist()
([4, 9], [False, True], [70, 80], [0, 0])
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

__all__ = ["RowPieces", "RowsTap", "tap_part"]

I64 = npt.NDArray[np.int64]


class RowPieces(NamedTuple):
    """A batch's rows (``epoch``, ``row``: its position in the epoch's rows, ``pad``:
    past the epoch's last row) and their pieces: ``piece_row`` (the row, as an index
    into the batch), ``doc`` (the document's global source index), ``start`` (the
    piece's first token, absolute within the document) and ``length``, sorted by row."""

    epoch: I64
    row: I64
    pad: npt.NDArray[np.bool_]
    piece_row: I64
    doc: I64
    start: I64
    length: I64

    @classmethod
    def join(cls, parts: list[tuple[I64, ...]], count: int) -> RowPieces:
        """One batch's ``RowPieces`` from the ``tap_part`` of each of its epochs."""
        epoch = np.zeros(count, dtype=np.int64)
        row = np.zeros(count, dtype=np.int64)
        pad = np.zeros(count, dtype=np.bool_)
        cols: list[list[I64]] = [[], [], [], []]
        for e, sel, mine, is_pad, *pieces in parts:
            epoch[sel], row[sel], pad[sel] = e, mine, is_pad.astype(np.bool_)
            for col, values in zip(cols, pieces, strict=True):
                col.append(values)
        empty = np.zeros(0, dtype=np.int64)
        piece_row, doc, start, length = (np.concatenate(c) if c else empty for c in cols)
        order = np.argsort(piece_row, kind="stable")
        return cls(epoch, row, pad, piece_row[order], doc[order], start[order], length[order])

    def tail(self, drop: int) -> RowPieces:
        """The rows from batch slot ``drop`` on (a resumed worker's first batch)."""
        if not drop:
            return self
        keep = self.piece_row >= drop
        return RowPieces(
            self.epoch[drop:],
            self.row[drop:],
            self.pad[drop:],
            self.piece_row[keep] - drop,
            self.doc[keep],
            self.start[keep],
            self.length[keep],
        )


#: ``rows_tap(rows, pieces) -> rows``: may wrap each row (the audit: ``(row, meta)``).
RowsTap = Callable[[list[Any], RowPieces], list[Any]]


def tap_part(
    epoch: int,
    sel: I64,
    mine: I64,
    num_rows: int,
    found: tuple[npt.NDArray[np.void], I64, I64, I64] | None,
) -> tuple[I64, ...]:
    """One epoch's share of a batch: its rows ``mine`` at batch slots ``sel`` (rows from
    ``num_rows`` on are pad rows) and, unless all are pad rows, ``found``: their pieces,
    the epoch positions and source indices of the documents they cut, and the pieces'
    absolute first tokens."""
    empty = np.zeros(0, dtype=np.int64)
    slot = doc = starts = length = empty
    if found is not None:
        pieces, where, index, first = found
        order = np.argsort(mine, kind="stable")
        slot = sel[order[np.searchsorted(mine[order], pieces["row"])]].astype(np.int64)
        doc = np.asarray(index, dtype=np.int64)[np.searchsorted(where, pieces["pos"])]
        starts = np.asarray(first, dtype=np.int64)
        length = pieces["len"].astype(np.int64)
    pad = (mine >= num_rows).astype(np.int64)
    return (np.asarray([epoch]), sel, mine, pad, slot, doc, starts, length)
