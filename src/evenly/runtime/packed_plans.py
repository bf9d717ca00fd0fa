"""An epoch's packed rows, planned once per node and memory-mapped by every process.

The plan of epoch ``e`` lives in ``cache_dir/packing`` under a key of everything it
depends on (the documents' lengths, their order: seed, epoch, shuffle; the packing
settings), written once by whichever process of the node comes first
(:func:`~evenly.sources._cachedir.publish`):

- ``concat``: the resume points, ``N / 1024`` int64 (``<key>-e<epoch>.concat``);
- ``best_fit``: a header, the pieces (24 bytes each, sorted by row) and a resume point
  every 1024 rows (``<key>-e<epoch>.best_fit``).

Planning epoch ``e`` removes the dataset's plans of epochs before ``e - 1``, so the
folder holds about two epochs' plans per dataset.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import struct
from typing import Any

import numpy as np
import numpy.typing as npt

from evenly.core.locks import ForkSafeLock
from evenly.core.packing.best_fit import ROW_STRIDE, FittedRows, best_fit_chunks
from evenly.core.packing.concat import STRIDE, ConcatRows, concat_checkpoints
from evenly.core.packing.pieces import PIECE, Lengths, RowTable
from evenly.core.packing.settings import Packing
from evenly.core.plan import Order
from evenly.sources._cachedir import cache_subdir, publish

__all__ = ["PlanFiles", "prune"]

I64 = npt.NDArray[np.int64]
_MAGIC = b"EVNPACK1"
_HEADER = struct.Struct("<8sqqqq")  # magic, rows, pieces, index entries, row stride
_HEADER_BYTES = 64


def _write_best_fit(path: str, lengths_at: Lengths, n: int, packing: Packing) -> None:
    marks: list[I64] = []
    num_rows = num_pieces = 0
    with open(path, "wb") as f:
        f.write(b"\0" * _HEADER_BYTES)
        for chunk in best_fit_chunks(
            lengths_at,
            n,
            seq_len=packing.seq_len,
            window=packing.window,
            open_rows=packing.open_rows,
        ):
            rows = chunk["row"]
            first = -(-num_rows // ROW_STRIDE) * ROW_STRIDE
            wanted = np.arange(first, int(rows[-1]) + 1, ROW_STRIDE, dtype=np.int64)
            marks.append(np.searchsorted(rows, wanted) + num_pieces)
            chunk.tofile(f)
            num_rows, num_pieces = int(rows[-1]) + 1, num_pieces + chunk.size
        index = np.concatenate([*marks, [num_pieces]]).astype(np.int64)
        index.tofile(f)
        f.seek(0)
        f.write(_HEADER.pack(_MAGIC, num_rows, num_pieces, index.size, ROW_STRIDE))


def _open_best_fit(path: str) -> FittedRows:
    with open(path, "rb") as f:
        magic, num_rows, num_pieces, entries, stride = _HEADER.unpack(f.read(_HEADER.size))
    expected = _HEADER_BYTES + num_pieces * PIECE.itemsize + entries * 8
    if magic != _MAGIC or os.path.getsize(path) != expected:
        raise ValueError(f"evenly: {path} is not a complete packing plan; remove it")
    if num_pieces == 0:
        return FittedRows(np.empty(0, dtype=PIECE), np.zeros(1, np.int64), 0, stride)
    pieces = np.memmap(path, dtype=PIECE, mode="r", offset=_HEADER_BYTES, shape=(num_pieces,))
    index = np.memmap(
        path,
        dtype=np.int64,
        mode="r",
        offset=_HEADER_BYTES + num_pieces * PIECE.itemsize,
        shape=(entries,),
    )
    return FittedRows(pieces, index, num_rows, stride)


class PlanFiles:
    """The epochs' row tables of one dataset in this process (the last few kept open)."""

    def __init__(
        self,
        packing: Packing,
        lengths: Any,
        lengths_key: str,
        total: int | None = None,
        cache_dir: str | None = None,
    ) -> None:
        self.packing = packing
        #: the node's cache directory the plans are written in (None: the default one)
        self.cache_dir = cache_dir
        self.lengths = lengths
        self.lengths_key = lengths_key
        #: an epoch's tokens (all the documents', or a token mixture's tokens_per_epoch)
        self.total = int(np.sum(lengths, dtype=np.int64)) if total is None else int(total)
        self._open: dict[tuple[Any, ...], RowTable] = {}
        self._lock = ForkSafeLock()  # reader threads share it; no reliance on the GIL

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_open"] = {}  # memory maps are mapped again
        return state

    @property
    def num_docs(self) -> int:
        return len(self.lengths)

    def concat_rows(self) -> int:
        """Rows of every epoch under ``concat`` (the same for every order)."""
        return -(-self.total // self.packing.seq_len)

    def lengths_at(self, order: Order | None) -> Lengths:
        lengths = self.lengths

        def at(positions: I64) -> I64:
            index = positions if order is None else order(positions)
            return np.asarray(lengths[index], dtype=np.int64)

        return at

    def table(
        self, epoch: int, order_key: tuple[Any, ...], order: Order | None, items: Any = None
    ) -> RowTable:
        """Epoch ``epoch``'s rows for the document order ``order`` (keyed, besides the
        epoch, by ``order_key``: seed, shuffle mode ...).  ``items``: a token mixture's
        epoch (:class:`~evenly.runtime.token_mix.TokenItems`), whose positions are
        pieces of documents with their own lengths."""
        opened = (epoch, order_key, None if items is None else items.key)
        with self._lock:
            found = self._open.get(opened)
        if found is not None:
            return found
        packing = self.packing
        n = self.num_docs if items is None else items.size
        text = f"{self.lengths_key}/{n}/{order_key}/{packing.plan_key()}"
        if items is not None:
            text += f"/{items.key}"
        key = hashlib.blake2b(text.encode(), digest_size=16).hexdigest()
        folder = cache_subdir("packing", self.cache_dir)
        path = os.path.join(folder, f"{key}-e{epoch}.{packing.strategy}")
        at = self.lengths_at(order) if items is None else items.lengths_at
        for attempt in (1, 2):  # a file removed by a later epoch's pruning is planned again
            try:
                table = self._publish(path, at, n)
                break
            except FileNotFoundError:
                if attempt == 2:
                    raise
        prune(folder, key, epoch, packing.strategy)
        with self._lock:
            if len(self._open) >= 3:
                self._open.pop(next(iter(self._open)))
            self._open[opened] = table
        return table

    def _publish(self, path: str, at: Lengths, n: int) -> RowTable:
        packing = self.packing
        if packing.strategy == "concat":
            publish(path, lambda tmp: concat_checkpoints(at, n, stride=STRIDE).tofile(tmp))
            blocks = -(-n // STRIDE) + 1
            if os.path.getsize(path) != 8 * blocks:
                raise ValueError(f"evenly: {path} is not a complete packing plan; remove it")
            cum = np.memmap(path, dtype=np.int64, mode="r", shape=(blocks,))
            return ConcatRows(np.asarray(cum), at, n, seq_len=packing.seq_len, stride=STRIDE)
        publish(path, lambda tmp: _write_best_fit(tmp, at, n, packing))
        return _open_best_fit(path)


def prune(folder: str, key: str, epoch: int, strategy: str) -> None:
    """Remove this dataset's plans of epochs before ``epoch - 1`` (a process still reading
    one keeps its memory map; one that needs it again plans it again)."""
    prefix, suffix = f"{key}-e", f".{strategy}"
    for name in os.listdir(folder):
        if name.startswith(prefix) and name.endswith(suffix):
            old = name[len(prefix) : -len(suffix)]
            if old.isdigit() and int(old) < epoch - 1:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(folder, name))
