"""Dict rows read straight from Arrow chunks (record batches, row groups) a source holds,
without an Arrow ``take`` per chunk: each chunk's columns are turned once into cheap
per-row accessors (numbers from a numpy array, strings and binary sliced from the data
buffer by their offsets), and a batch's rows are built from those.

The rows equal :func:`evenly.sources._columns.to_rows` of the same rows (numbers as
Python scalars, ``str``, ``bytes``).  A chunk holding nulls or another column type has no
accessors (``None``): the caller reads it the general way.

>>> import pyarrow as pa
>>> t = pa.table({"n": pa.array([1, 2, 3], pa.int16()), "s": ["a", "bc", "d"],
...               "b": [b"x", b"", b"yz"]})
>>> access = RowAccess.of(t)
>>> [access.row(i) for i in (2, 0)]
[{'n': 3, 's': 'd', 'b': b'yz'}, {'n': 1, 's': 'a', 'b': b'x'}]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa

from ._gather import numbers

__all__ = ["RowAccess"]


def _binary(arr: pa.Array, text: bool) -> Callable[[int], Any]:
    large = pa.types.is_large_binary(arr.type) or pa.types.is_large_string(arr.type)
    _, offsets_buf, data_buf = arr.buffers()
    width = 8 if large else 4
    # the offsets in place: a memoryview gives Python ints as fast as a list, no copy
    raw = memoryview(offsets_buf)[arr.offset * width : (arr.offset + len(arr) + 1) * width]
    bounds = raw.cast("q" if large else "i")
    data = memoryview(data_buf) if data_buf is not None else memoryview(b"")

    if text:

        def get_text(i: int) -> str:
            return str(data[bounds[i] : bounds[i + 1]], "utf-8")

        return get_text

    def get_bytes(i: int) -> bytes:
        return data[bounds[i] : bounds[i + 1]].tobytes()

    return get_bytes


def _accessor(arr: pa.Array) -> tuple[Callable[[int], Any], int] | None:
    """A column's per-row accessor and the memory it holds beyond the column's buffers
    (a numpy copy of bools; numbers, strings and binary are read in place)."""
    t = arr.type
    if arr.null_count:
        return None
    if pa.types.is_integer(t) or pa.types.is_floating(t):
        return numbers(arr).item, 0
    if pa.types.is_boolean(t):
        values = np.asarray(arr.to_numpy(zero_copy_only=False))
        get: Callable[[int], Any] = values.item
        return get, len(arr)
    if pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return _binary(arr, text=False), 0
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return _binary(arr, text=True), 0
    return None


class RowAccess:
    """Per-row accessors for every column of one chunk."""

    __slots__ = ("getters", "names", "nbytes")

    def __init__(self, names: list[str], getters: list[Callable[[int], Any]], nbytes: int) -> None:
        self.names = names
        self.getters = getters
        #: memory the accessors hold beyond the chunk's own buffers (an estimate)
        self.nbytes = nbytes

    @classmethod
    def of(cls, chunk: pa.Table | pa.RecordBatch) -> RowAccess | None:
        """The accessors of ``chunk``, or None if some column has none."""
        getters = []
        extra = 0
        for column in chunk.columns:
            arr = column
            if isinstance(column, pa.ChunkedArray):  # combining copies: only when needed
                if column.num_chunks == 1:
                    arr = column.chunk(0)
                else:
                    arr = column.combine_chunks()
                    extra += arr.nbytes
            found = _accessor(arr)
            if found is None:
                return None
            getters.append(found[0])
            extra += found[1]
        return cls(list(chunk.schema.names), getters, extra)

    def row(self, i: int) -> dict[str, Any]:
        """Row ``i`` of the chunk as a dict."""
        return {name: get(i) for name, get in zip(self.names, self.getters, strict=True)}
