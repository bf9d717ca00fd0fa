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

__all__ = [
    "IGNORE",
    "PIECE",
    "Empty",
    "Lengths",
    "RowTable",
    "assemble",
    "distinct",
    "fresh",
    "piece_tokens",
    "pieces_of",
    "place",
]

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


def distinct(values: npt.ArrayLike) -> tuple[I64, I64]:
    """``np.unique(values, return_inverse=True)`` for a 1-D array, with no sort where the
    values come non-decreasing already (a batch's rows, ``concat``'s pieces).

    >>> [a.tolist() for a in distinct([3, 3, 5, 9, 9])], distinct([2, 1, 2])[0].tolist()
    ([[3, 5, 9], [0, 0, 1, 2, 2]], [1, 2])
    """
    v = np.asarray(values, dtype=np.int64).reshape(-1)
    if v.size > 1 and not bool((v[1:] >= v[:-1]).all()):
        found, inverse = np.unique(v, return_inverse=True)
        return found, inverse.reshape(-1)
    new = np.ones(v.size, dtype=np.bool_)
    np.not_equal(v[1:], v[:-1], out=new[1:])
    return v[new], np.cumsum(new) - 1


#: where the arrays a batch is built in come from: ``empty(name, size)`` gives an int64
#: array of ``size`` elements for ``name`` ("flat", "ramp", or an output's name)
Empty = Callable[[str, int], I64]


def fresh(name: str, size: int) -> I64:
    """The default :data:`Empty`: a new array."""
    return np.empty(size, dtype=np.int64)


def piece_tokens(
    pieces: npt.NDArray[np.void],
    tokens: Mapping[int, npt.NDArray[np.integer]],
    empty: Empty = fresh,
) -> I64:
    """The tokens of every piece, one after the other (int64): one copy of each token."""
    if not pieces.size:
        return np.zeros(0, dtype=np.int64)
    parts = [
        tokens[pos][start : start + n]
        for pos, start, n in zip(
            pieces["pos"].tolist(), pieces["start"].tolist(), pieces["len"].tolist(), strict=True
        )
    ]
    out = empty("flat", sum(len(part) for part in parts))
    return np.concatenate(parts, out=out, casting="unsafe")


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
    flat = piece_tokens(pieces, tokens)
    index = np.asarray([doc_index[p] for p in pieces["pos"].tolist()], dtype=np.int64)
    return place(rows, pieces, flat, seq_len=seq_len, pad_id=pad_id, doc_index=index)


def place(
    rows: I64,
    pieces: npt.NDArray[np.void],
    flat: I64,
    *,
    seq_len: int,
    pad_id: int,
    doc_index: I64 | None = None,
    empty: Empty = fresh,
) -> dict[str, I64]:
    """:func:`assemble` from the pieces' tokens already gathered (``flat``, from
    :func:`piece_tokens`) and each piece's source index (``doc_index``; ``None``: no
    ``document_ids``): one pass over each output array, no Python per token.  ``empty``
    gives the arrays they are built in (default: fresh ones)."""
    count = len(rows)
    lens = pieces["len"].astype(np.int64)
    begins = np.cumsum(lens) - lens  # where each piece starts in flat
    ramp = _ramp(seq_len)
    position = np.concatenate(
        [ramp[:n] for n in lens.tolist()] or [ramp[:0]], out=empty("ramp", flat.size)
    )
    columns = {"input_ids": (flat, pad_id), "position_ids": (position, 0), "labels": (flat, IGNORE)}
    if doc_index is not None:
        columns["document_ids"] = (np.repeat(doc_index + 1, lens), 0)
    slot = np.searchsorted(rows, pieces["row"])  # the output row of each piece
    if flat.size == count * seq_len:  # every row full: the gathered tokens are the rows
        starts = begins
        out = {k: v.reshape(count, seq_len) for k, (v, _) in columns.items()}
        labels = empty("labels", flat.size).reshape(count, seq_len)
        np.copyto(labels, out["labels"])
        out["labels"] = labels
    else:
        new_row = np.ones(slot.size, dtype=np.bool_)
        new_row[1:] = slot[1:] != slot[:-1]
        first = np.flatnonzero(new_row)  # each row's first piece
        filled = slot[first].tolist()
        lo = begins[first]
        spans = list(zip(filled, lo.tolist(), np.append(lo, flat.size)[1:].tolist(), strict=True))
        out = {}
        for key, (values, fill) in columns.items():
            array = empty(key, count * seq_len).reshape(count, seq_len)
            array.fill(fill)
            for b, start, end in spans:
                array[b, : end - start] = values[start:end]
            out[key] = array
        starts = slot * seq_len + begins - np.repeat(lo, np.diff(np.append(first, slot.size)))
    out["labels"].reshape(-1)[starts[lens > 0]] = IGNORE  # every piece's first token
    return out


_RAMPS: dict[int, I64] = {}


def _ramp(seq_len: int) -> I64:
    """``0, 1, ..., seq_len - 1`` (made once per ``seq_len``)."""
    found = _RAMPS.get(seq_len)
    if found is None:
        found = _RAMPS[seq_len] = np.arange(seq_len, dtype=np.int64)
        found.flags.writeable = False
    return found
