"""Token ids of a list column, read as numpy views (no row dicts, no per-token Python): the
``read_tokens(indices, field)`` capability of the Arrow-backed sources, which packing
uses to read its documents.

For each chunk (record batch, row group) a batch touches, the column's values and list
offsets are taken once as zero-copy numpy arrays (for Arrow IPC files, views of the
memory map); each document is then one slice.  This is what makes a packed row cost a
few microseconds per document instead of building a dict and a copy per row.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa

__all__ = ["TokenSpan", "TokenViews", "arrow_token_ranges", "list_tokens", "token_views"]

I64 = npt.NDArray[np.int64]

#: a chunk's list column as (values, offsets, valid) numpy arrays (``valid``: None when
#: no document is null or holds a null token)
TokenViews = tuple[npt.NDArray[Any], npt.NDArray[np.int64], npt.NDArray[np.bool_] | None]


def token_views(chunk: pa.RecordBatch | pa.Table, field: str) -> TokenViews:
    """The ``field`` list column of one chunk as ``(values, offsets, valid)``: document
    ``j`` is ``values[offsets[j]:offsets[j + 1]]`` where ``valid`` (None: all) holds."""
    column: Any = chunk.column(field)
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    kind = column.type
    if pa.types.is_fixed_size_list(kind):
        values = column.flatten()
        size = kind.list_size
        offsets = np.arange(0, (len(column) + 1) * size, size, dtype=np.int64)
    elif pa.types.is_list(kind) or pa.types.is_large_list(kind):
        values = column.values
        offsets = column.offsets
    else:
        raise TypeError(f"column {field!r} is {kind}, not a list of token ids")
    if isinstance(offsets, pa.Array):
        offsets = _numpy(offsets).astype(np.int64)
    if not column.null_count and not values.null_count:
        return _numpy(values), offsets, None
    valid = np.asarray(column.is_valid(), dtype=np.bool_)
    if values.null_count:  # a document holding a null token is no list of ids either
        nulls = np.concatenate([[0], np.cumsum(np.asarray(values.is_null()))])
        valid &= nulls[offsets[1:]] == nulls[offsets[:-1]]
    return _numpy(values.fill_null(0)), offsets, valid


def _numpy(array: pa.Array) -> npt.NDArray[Any]:
    """An Arrow array as numpy: an integer one without nulls as a view of its data buffer
    (no copy; and pyarrow's ``to_numpy`` imports pandas on its first call, a third of a
    second in each worker's first packed batch)."""
    kind = array.type
    if array.null_count or not pa.types.is_integer(kind):
        return np.asarray(array.to_numpy(zero_copy_only=False))
    signed = "i" if pa.types.is_signed_integer(kind) else "u"
    dtype = np.dtype(f"{signed}{kind.bit_width // 8}")
    data = array.buffers()[1]
    if data is None or not len(array):
        return np.zeros(0, dtype=dtype)
    start = array.offset * dtype.itemsize
    return np.frombuffer(data, dtype=dtype, count=len(array), offset=start)


def list_tokens(source: Any, indices: Sequence[int], field: str) -> list[npt.NDArray[Any]]:
    """The token ids of ``field`` for each sample of ``indices`` (an ``ArrowBatchSource``),
    in the order asked: one numpy slice per document, read-only views where the format
    allows (Arrow IPC: the memory map)."""
    if field not in source.schema.names:
        raise ValueError(
            f"{source._what}: packing reads the token ids from column {field!r}, which is "
            f"not in the schema {source.schema.names}; pass Packing(field=...)"
        )
    samples = source._check_indices(indices)
    rows = source._rows(samples)
    chunk = source._chunk_of.of(rows)
    local = (rows - source._cstarts[chunk]).tolist()
    views: dict[int, TokenViews] = {}
    # each file opened (and checked unchanged) once per call, where all stay open
    handles: dict[int, Any] | None = {} if len(source.urls) <= source.max_open_files else None
    out: list[npt.NDArray[Any]] = []
    for j, (c, i) in enumerate(zip(chunk.tolist(), local, strict=True)):
        found = views.get(c)
        if found is None:
            k, g = int(source._cshard[c]), int(source._clocal[c])
            try:
                handle = None if handles is None else handles.get(k)
                if handle is None:
                    handle = source._handle(k)
                    if handles is not None:
                        handles[k] = handle
                found = source._token_views(k, g, handle, field)
            except Exception as exc:
                raise source._error(exc, int(samples[j])) from exc
            views[c] = found
        values, offsets, valid = found
        if valid is not None and not valid[i]:
            raise ValueError(
                f"{source._what}: sample {int(samples[j])} ({source.locate(int(samples[j]))}): "
                f"column {field!r} holds a null there: a document needs a list of token ids"
            )
        out.append(values[offsets[i] : offsets[i + 1]])
    return out


class _Window:
    """A read-only 1-D window of ``dtype`` from one address on, across several arrays
    (their memory held by ``keep``): one fancy index reads elements of all of them; only
    addresses inside the arrays are ever read."""

    def __init__(self, low: int, count: int, dtype: np.dtype[Any], keep: list[Any]) -> None:
        self.keep = keep
        self.__array_interface__ = {
            "version": 3,
            "shape": (count,),
            "typestr": dtype.str,
            "data": (low, True),
        }


def _address(array: npt.NDArray[Any]) -> int:
    data: tuple[int, bool] = array.__array_interface__["data"]
    return data[0]


def _window(arrays: list[npt.NDArray[Any]]) -> tuple[npt.NDArray[Any], npt.NDArray[np.int64]]:
    """One window over ``arrays`` (one dtype, aligned to it) and where each starts in it."""
    dtype = arrays[0].dtype
    size = dtype.itemsize
    used = [a for a in arrays if a.size]
    addresses = np.array([_address(a) for a in arrays], dtype=np.int64)
    low = min((_address(a) for a in used), default=0)
    high = max((_address(a) + a.size * size for a in used), default=low + size)
    bases = np.where([a.size > 0 for a in arrays], (addresses - low) // size, 0)
    return np.asarray(_Window(low, max((high - low) // size, 1), dtype, arrays)), bases


class TokenSpan:
    """Every chunk's token ids and list offsets of one column as two windows (packing's
    fast reads: a group's documents located, and its pieces' tokens gathered, with one
    fancy index each and no Python per document).

    ``of(views)``: the ``(values, offsets, valid)`` of every chunk of the source, in
    order; None when a chunk has nulls, the values are not all of one integer dtype, or an
    array is not aligned to its dtype (then the per-document reads apply)."""

    def __init__(self, values: list[npt.NDArray[Any]], offsets: list[npt.NDArray[np.int64]]):
        self.values, self._vbase = _window(values)
        self.offsets, self._obase = _window(offsets)

    @classmethod
    def of(cls, views: list[TokenViews]) -> TokenSpan | None:
        if not views or any(valid is not None for _, _, valid in views):
            return None
        values = [np.ascontiguousarray(v) for v, _, _ in views]
        offsets = [np.ascontiguousarray(o, dtype=np.int64) for _, o, _ in views]
        if len({v.dtype for v in values}) != 1 or values[0].dtype.kind not in "iu":
            return None
        for arrays in (values, offsets):
            if any(_address(a) % a.dtype.itemsize for a in arrays):
                return None
        return cls(values, offsets)

    def ranges(
        self, chunks: npt.NDArray[np.int64], local: npt.NDArray[np.int64]
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """Where document ``local[j]`` of chunk ``chunks[j]`` starts in :attr:`values`, and
        how many tokens it holds."""
        at = self._obase[chunks] + local
        first = self.offsets[at]
        return self._vbase[chunks] + first, self.offsets[at + 1] - first

    def gather(
        self, starts: npt.NDArray[np.int64], lengths: npt.NDArray[np.int64], out: I64
    ) -> I64:
        """The tokens of ranges ``[starts[j], starts[j] + lengths[j])`` of :attr:`values`,
        one after the other, into ``out`` (int64, ``lengths.sum()`` of them; one slice a
        range: a copy of each run of tokens, cheaper than building an index per token)."""
        if not starts.size:
            return out
        values = self.values
        runs = [values[a : a + n] for a, n in zip(starts.tolist(), lengths.tolist(), strict=True)]
        return np.concatenate(runs, out=out, casting="unsafe")


def arrow_token_ranges(
    source: Any, indices: npt.NDArray[np.int64], field: str
) -> tuple[TokenSpan, I64, I64] | None:
    """``ArrowSource.token_ranges``: the span of ``field`` over every file (made once per
    process, made again if a file was closed since), and where each document starts in
    it and how many tokens it holds; each file they are in checked unchanged first."""
    spans: dict[str, tuple[TokenSpan | None, list[Any]]]
    spans = source.__dict__.setdefault("_spans", {})
    if source.__dict__.get("_spans_pid") != os.getpid():
        spans.clear()
        source._spans_pid = os.getpid()
    if field not in spans:
        if field not in source.schema.names:
            return None  # read_tokens names the missing column
        views: list[Any] = []
        for k in range(len(source.urls)):
            handle = source._handle(k)
            views.extend(
                source._token_views(k, g, handle, field) for g in range(len(handle.batches))
            )
        built = [source._handles.get(k) for k in range(len(source.urls))]
        spans[field] = (TokenSpan.of(views), built)
    span, built = spans[field]
    if span is None:
        return None
    rows = source._rows(source._check_indices(indices))
    chunk = source._chunk_of.of(rows)
    if not source._unchanged(source._cshard[chunk], built):
        del spans[field]  # a file was closed since: map them again
        return arrow_token_ranges(source, indices, field)
    starts, lengths = span.ranges(chunk, rows - source._cstarts[chunk])
    return span, starts, lengths
