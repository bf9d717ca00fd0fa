"""Gathering a batch of fixed-width columns straight from memory-mapped Arrow record
batches: one byte window per column spanning every record batch of every file, one
gather per column a read (numpy's fancy index, or torch's ``index_select`` into a
recycled buffer for a group of batches), no Arrow ``take`` and no per-row Python object.

Used by the Arrow source for local files when every selected column is a number (not a
bool: Arrow packs those in bits) or a fixed-size list of numbers, with no nulls; the
result equals :func:`evenly.sources._columns.to_columns` of the rows (ints as int64,
floats as float64, fixed-size lists as ``[B, L]`` of their own dtype).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa

__all__ = ["LIST_VALUES", "ChunkLookup", "ColumnViews", "chunk_views", "gatherable", "numbers"]


def numbers(arr: pa.Array) -> npt.NDArray[Any]:
    """A zero-copy numpy view of an integer or float column chunk with no nulls (what
    ``arr.to_numpy(zero_copy_only=True)`` gives, without the ~100 KiB of heap that call
    leaves behind per chunk)."""
    dtype = np.dtype(arr.type.to_pandas_dtype())
    data = arr.buffers()[1]
    if data is None or not len(arr):
        return np.zeros(0, dtype=dtype)
    return np.frombuffer(data, dtype=dtype, count=len(arr), offset=arr.offset * dtype.itemsize)


def _view(arr: pa.Array) -> npt.NDArray[Any] | None:
    """A zero-copy numpy view of a fixed-width numeric column chunk (``[n]`` or
    ``[n, L]``), or None if it has nulls or another type."""
    t = arr.type
    if arr.null_count:
        return None
    if pa.types.is_fixed_size_list(t):
        values = arr.values
        if values.null_count or not (
            pa.types.is_integer(values.type) or pa.types.is_floating(values.type)
        ):
            return None
        flat = numbers(values)
        size = t.list_size
        start = arr.offset * size
        return np.asarray(flat[start : start + len(arr) * size]).reshape(len(arr), size)
    if pa.types.is_integer(t) or pa.types.is_floating(t):
        return numbers(arr)
    return None


#: numpy dtypes torch stacks as they are (unsigned wider than 8 bits are not all supported)
LIST_VALUES = ("int8", "int16", "int32", "int64", "uint8", "float16", "float32", "float64", "bool")


def gatherable(schema: pa.Schema) -> bool:
    """Whether every column can be gathered this way (by type; nulls are checked per
    record batch): numbers (collated to int64 / float64, as ``default_collate`` does for
    Python numbers) and fixed-size lists of the numbers torch stacks as they are."""

    def ok(t: pa.DataType) -> bool:
        if pa.types.is_fixed_size_list(t):
            value = t.value_type
            numeric = pa.types.is_integer(value) or pa.types.is_floating(value)
            return numeric and np.dtype(value.to_pandas_dtype()).name in LIST_VALUES
        return (pa.types.is_integer(t) and not pa.types.is_uint64(t)) or pa.types.is_floating(t)

    return len(schema) > 0 and all(ok(f.type) for f in schema)


class _Span:
    """A read-only byte window from one address to another, across the record batches
    of every mapped file (so one fancy index gathers a column's rows from all of them;
    only addresses of rows inside the batches are ever read, and the views in
    ``keep`` hold those batches' memory for as long as the window lives)."""

    def __init__(
        self, low: int, count: int, width: int, keep: list[npt.NDArray[Any]], readonly: bool = True
    ) -> None:
        self.keep = keep
        self.__array_interface__ = {
            "version": 3,
            "shape": (count, width),
            "strides": (1, 1),
            "typestr": "|u1",
            "data": (low, readonly),
        }


def _address(view: npt.NDArray[Any]) -> int:
    data: tuple[int, bool] = view.__array_interface__["data"]
    return data[0]


def chunk_views(chunk: pa.RecordBatch | pa.Table) -> list[npt.NDArray[Any]] | None:
    """Zero-copy numpy views of a chunk's columns, or None if one has nulls, is not
    fixed-width or is split in pieces."""
    views = []
    for column in chunk.columns:
        if isinstance(column, pa.ChunkedArray):
            if column.num_chunks != 1:
                return None
            column = column.chunk(0)
        v = _view(column)
        if v is None or not v.flags.c_contiguous:
            return None
        views.append(v)
    return views


class ColumnViews:
    """Every column of a set of chunks, as one byte window per column over all of
    them: a batch's rows of a column are gathered with a single fancy index."""

    def __init__(self, names: list[str], chunks: Sequence[list[npt.NDArray[Any]]]) -> None:
        self.names = names
        first = chunks[0] if chunks else []
        self.dtypes = [_collated(v.dtype) if v.ndim == 1 else v.dtype for v in first]
        self.raw = [v.dtype for v in first]
        self.shapes = [v.shape[1:] for v in first]
        self.widths = [v.itemsize * int(np.prod(v.shape[1:], dtype=np.int64)) for v in first]
        self.starts: list[npt.NDArray[np.int64]] = []  # per column: each chunk's offset
        self.spans: list[npt.NDArray[np.uint8]] = []
        self._windows: list[_Span] = []
        self._torch: list[Any] | None = None
        self._pools: list[Any] = []  # per column: the recycled buffers of gather_group
        for j, width in enumerate(self.widths):
            addresses = np.array([_address(c[j]) for c in chunks], dtype=np.int64)
            lengths = np.array([len(c[j]) for c in chunks], dtype=np.int64)
            used = lengths > 0
            low = int(addresses[used].min()) if used.any() else 0
            high = int((addresses + lengths * width)[used].max()) if used.any() else width
            keep = [c[j] for c in chunks]
            self.starts.append(np.where(used, addresses - low, 0))
            span = _Span(low, max(high - low - width + 1, 1), max(width, 1), keep)
            self.spans.append(np.asarray(span))
            # the same window marked writable for torch (which warns on read-only arrays):
            # only ever read, as the source of torch's gather
            count = max(high - low - width + 1, 1)
            self._windows.append(_Span(low, count, max(width, 1), keep, readonly=False))

    @classmethod
    def of_batches(cls, batches: Sequence[pa.RecordBatch]) -> ColumnViews:
        """The views of every record batch (ValueError if one cannot be gathered)."""
        chunks = []
        for b in batches:
            views = chunk_views(b)
            if views is None:
                raise ValueError("a record batch holds nulls or a column that is not fixed-width")
            chunks.append(views)
        return cls(batches[0].schema.names if batches else [], chunks)

    def gather(
        self, chunks: npt.NDArray[np.int64], local: npt.NDArray[np.int64]
    ) -> dict[str, npt.NDArray[Any]]:
        """Rows ``local[j]`` of chunk ``chunks[j]``, in that order."""
        out: dict[str, npt.NDArray[Any]] = {}
        n = chunks.size
        for j, name in enumerate(self.names):
            width = self.widths[j]
            rows = self.spans[j][self.starts[j][chunks] + local * width]
            column = rows.view(self.raw[j]).reshape(n, *self.shapes[j])
            dtype = self.dtypes[j]
            out[name] = column if column.dtype == dtype else column.astype(dtype)
        return out

    def gather_group(
        self, chunks: npt.NDArray[np.int64], local: npt.NDArray[np.int64]
    ) -> dict[str, npt.NDArray[Any]]:
        """What :meth:`gather` returns, gathered by torch (which releases the GIL for
        the whole copy) into recycled buffers (:class:`evenly.transport.pool.BufferPool`,
        one per column): a steady stream of groups reuses the same memory instead of
        faulting in fresh pages, and a buffer is reused only once no array or tensor
        views it."""
        import torch

        from evenly.transport.pool import BufferPool

        if not all(self.widths):  # a fixed-size list of size 0: nothing to copy
            return self.gather(chunks, local)
        if self._torch is None:
            self._torch = [torch.from_numpy(np.asarray(w)) for w in self._windows]
            self._pools = [BufferPool(keep=2) for _ in self.names]
        n = chunks.size
        out: dict[str, npt.NDArray[Any]] = {}
        for j, name in enumerate(self.names):
            width = self.widths[j]
            rows = self._pools[j].empty((n, width), np.uint8)
            offsets = torch.from_numpy(self.starts[j][chunks] + local * width)
            torch.index_select(self._torch[j], 0, offsets, out=torch.from_numpy(rows))
            column = rows.view(self.raw[j]).reshape(n, *self.shapes[j])
            dtype = self.dtypes[j]
            out[name] = column if column.dtype == dtype else column.astype(dtype)
        return out


class ChunkLookup:
    """Which chunk holds each row: ``np.searchsorted(starts, rows, side="right") - 1``
    (``starts``: each chunk's first row, then the total; empty chunks allowed), found
    with three table lookups instead of a binary search per row (a random batch's binary
    searches mispredict at every step: ~5x slower).

    The rows are cut in buckets of ``step`` rows, the size of the smallest non-empty
    chunk, so a bucket meets at most two chunks: the one holding its first row, and the
    next non-empty one.  The tables are kept only when the buckets are few (at most 4
    per chunk, or 4096): else the binary search.

    >>> starts = np.array([0, 3, 3, 10, 12])
    >>> ChunkLookup(starts).of(np.array([11, 0, 3, 2, 9])).tolist()
    [3, 0, 2, 0, 2]
    """

    def __init__(self, starts: npt.NDArray[np.int64]) -> None:
        self.starts = starts
        sizes = np.diff(starts)
        used = sizes[sizes > 0]
        total = int(starts[-1]) if starts.size else 0
        self.step = int(used.min()) if used.size else 0
        buckets = -(-total // self.step) if self.step else 0
        self.first: npt.NDArray[np.int64] | None = None
        if 0 < buckets <= max(4 * sizes.size, 4096):
            at = np.arange(buckets, dtype=np.int64) * self.step
            self.first = np.searchsorted(starts, at, side="right") - 1  # holds row `at`
            self.end = starts[self.first + 1]  # ... and ends here
            last = sizes.size - 1
            self.after = np.minimum(np.searchsorted(starts, self.end, side="right") - 1, last)

    def of(self, rows: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """The chunk of each row (rows in ``[0, total)``)."""
        first = self.first
        if first is None:
            found: npt.NDArray[np.int64] = np.searchsorted(self.starts, rows, side="right") - 1
            return found
        b = rows // self.step
        return np.where(rows >= self.end[b], self.after[b], first[b])


def _collated(dtype: np.dtype[Any]) -> np.dtype[Any]:
    """What ``default_collate`` makes of Python numbers: int64 or float64."""
    return np.dtype(np.float64) if dtype.kind == "f" else np.dtype(np.int64)
