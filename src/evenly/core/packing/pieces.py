"""Rows as pieces of documents, and rows as token arrays.

A *piece* is ``(row, pos, start, len)``: tokens ``[start, start + len)`` of the document
at position ``pos`` of the epoch's document order, in row ``row``.  A row's pieces come
one after the other from its first token; what is left of the row is padding.  A pad
row (past the epoch's rows) has no piece.

Pure numpy: no torch, no I/O.

>>> p = pieces_of([0, 0, 1], [4, 7, 7], [0, 0, 2], [3, 1, 2])
>>> rows = assemble(np.array([0, 1, 2]), p, {4: np.array([5, 6, 7]),
...                 7: np.array([8, 9, 10, 11])}, seq_len=4, pad_id=0, doc_index={4: 0, 7: 1})
>>> rows["input_ids"].tolist()
[[5, 6, 7, 8], [10, 11, 0, 0], [0, 0, 0, 0]]
>>> rows["position_ids"].tolist(), rows["labels"].tolist()[1]
([[0, 1, 2, 0], [0, 1, 0, 0], [0, 0, 0, 0]], [-100, 11, -100, -100])
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

import numpy as np
import numpy.typing as npt

__all__ = ["IGNORE", "PIECE", "Lengths", "RowTable", "assemble", "pieces_of"]

I64 = npt.NDArray[np.int64]
#: One piece of a document in a row (24 bytes, the layout of the plan files too).
PIECE = np.dtype([("row", "<i8"), ("pos", "<i8"), ("start", "<i4"), ("len", "<i4")])
#: The label of a token the loss ignores (torch's ``CrossEntropyLoss`` default).
IGNORE = -100
#: position -> token count of the document there (vectorised)
Lengths = Callable[[I64], I64]


class RowTable(Protocol):
    """An epoch's rows: how many, and the pieces of any of them."""

    @property
    def num_rows(self) -> int: ...

    def pieces(self, rows: I64) -> npt.NDArray[np.void]:
        """The pieces of the given rows (ascending, distinct), sorted by row."""
        ...


def pieces_of(
    row: npt.ArrayLike, pos: npt.ArrayLike, start: npt.ArrayLike, length: npt.ArrayLike
) -> npt.NDArray[np.void]:
    """A piece array from its four columns."""
    rows = np.asarray(row, dtype=np.int64)
    out = np.empty(rows.shape[0], dtype=PIECE)
    out["row"], out["pos"], out["start"], out["len"] = rows, pos, start, length
    return out


def assemble(
    rows: I64,
    pieces: npt.NDArray[np.void],
    tokens: Mapping[int, npt.NDArray[np.integer]],
    *,
    seq_len: int,
    pad_id: int,
    doc_index: Mapping[int, int],
) -> dict[str, I64]:
    """The ``[len(rows), seq_len]`` arrays of the given rows: ``input_ids``,
    ``position_ids``, ``labels`` and ``document_ids`` (source index + 1, 0 for pads).

    ``pieces`` are those of ``rows`` (sorted by row); ``tokens[pos]`` the tokens of the
    document at position ``pos``, ``doc_index[pos]`` its source index.  A row without
    pieces (a pad row) is all ``pad_id``.
    """
    count = len(rows)
    input_ids = np.full((count, seq_len), pad_id, dtype=np.int64)
    position_ids = np.zeros((count, seq_len), dtype=np.int64)
    document_ids = np.zeros((count, seq_len), dtype=np.int64)
    slot = np.searchsorted(rows, pieces["row"])
    fill = np.zeros(count, dtype=np.int64)
    ramp = np.arange(seq_len, dtype=np.int64)
    for b, pos, start, n in zip(
        slot.tolist(),
        pieces["pos"].tolist(),
        pieces["start"].tolist(),
        pieces["len"].tolist(),
        strict=True,
    ):
        at = int(fill[b])
        input_ids[b, at : at + n] = tokens[pos][start : start + n]
        position_ids[b, at : at + n] = ramp[:n]
        document_ids[b, at : at + n] = doc_index[pos] + 1
        fill[b] = at + n
    labels = np.where(position_ids == 0, IGNORE, input_ids)
    return {
        "input_ids": input_ids,
        "position_ids": position_ids,
        "labels": labels,
        "document_ids": document_ids,
    }
