"""Gathering a batch of fixed-width columns straight from memory-mapped Arrow record
batches with numpy: one zero-copy view per (record batch, column), one fancy index per
record batch a batch touches, no Arrow ``take`` and no per-row Python object.

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

__all__ = ["ColumnViews", "gatherable"]


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
        flat = values.to_numpy(zero_copy_only=True)
        size = t.list_size
        start = arr.offset * size
        return np.asarray(flat[start : start + len(arr) * size]).reshape(len(arr), size)
    if pa.types.is_integer(t) or pa.types.is_floating(t):
        return np.asarray(arr.to_numpy(zero_copy_only=True))
    return None


def gatherable(schema: pa.Schema) -> bool:
    """Whether every column can be gathered this way (by type; nulls are checked per
    record batch)."""

    def ok(t: pa.DataType) -> bool:
        if pa.types.is_fixed_size_list(t):
            t = t.value_type
        return (pa.types.is_integer(t) and not pa.types.is_uint64(t)) or pa.types.is_floating(t)

    return len(schema) > 0 and all(ok(f.type) for f in schema)


class ColumnViews:
    """Numpy views of every column of every record batch, in global chunk order."""

    def __init__(self, batches: Sequence[pa.RecordBatch]) -> None:
        self.names = batches[0].schema.names if batches else []
        self.views: list[list[npt.NDArray[Any]]] = []
        for b in batches:
            views = [_view(b.column(i)) for i in range(b.num_columns)]
            if any(v is None for v in views):
                raise ValueError("a record batch holds nulls or a column that is not fixed-width")
            self.views.append([v for v in views if v is not None])
        first = self.views[0] if self.views else []
        self.dtypes = [_collated(v.dtype) if v.ndim == 1 else v.dtype for v in first]
        self.shapes = [v.shape[1:] for v in first]

    def gather(
        self, chunks: npt.NDArray[np.int64], local: npt.NDArray[np.int64]
    ) -> dict[str, npt.NDArray[Any]]:
        """Rows ``local[j]`` of chunk ``chunks[j]``, in that order."""
        n = chunks.size
        out = [
            np.empty((n, *shape), dtype=dtype)
            for shape, dtype in zip(self.shapes, self.dtypes, strict=True)
        ]
        order = np.argsort(chunks, kind="stable")
        present, first = np.unique(chunks[order], return_index=True)
        bounds = [*first.tolist(), n]
        for j, c in enumerate(present.tolist()):
            where = order[bounds[j] : bounds[j + 1]]
            rows = local[where]
            for column, view in zip(out, self.views[c], strict=True):
                column[where] = view[rows]
        return dict(zip(self.names, out, strict=True))


def _collated(dtype: np.dtype[Any]) -> np.dtype[Any]:
    """What ``default_collate`` makes of Python numbers: int64 or float64."""
    return np.dtype(np.float64) if dtype.kind == "f" else np.dtype(np.int64)
