"""Token counts of a list column, from the Arrow list offsets (no per-token Python): the
``token_lengths(field)`` capability of the Arrow-backed sources (Arrow IPC, Parquet, HF
``datasets``), which packing reads once per source and caches."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

__all__ = ["list_lengths"]


def list_lengths(source: Any, field: str) -> npt.NDArray[np.int32]:
    """One int32 per sample of ``source`` (an ``ArrowBatchSource``): the length of its
    ``field`` list; a missing column, a non-list column or a null raise, naming them."""
    if field not in source.schema.names:
        raise ValueError(
            f"{source._what}: packing reads the token ids from column {field!r}, which is not "
            f"in the schema {source.schema.names}; pass Packing(field=...)"
        )
    kind = source.schema.field(field).type
    if not (
        pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)
    ):
        raise TypeError(
            f"{source._what}: column {field!r} is {kind}, not a list of token ids; pass "
            f"Packing(field=...) naming a list column, or Packing(tokenize=...) for text"
        )
    parts = []
    for k, groups in enumerate(source._chunk_rows):
        handle = source._handle(k)
        for g in range(len(groups)):
            if isinstance(handle, pq.ParquetFile):  # only that column's offsets decoded
                column = handle.read_row_group(g, columns=[field]).column(field)
            else:
                column = source._chunk(k, g, handle).column(field)
            lengths = pc.list_value_length(column)
            if lengths.null_count:
                first = int(np.flatnonzero(np.asarray(lengths.is_null()))[0])
                raise ValueError(
                    f"{source._what}: column {field!r} is null at {source.urls[k]} row "
                    f"{sum(groups[:g]) + first}: a document needs a list of token ids"
                )
            parts.append(np.asarray(lengths, dtype=np.int64))
    rows = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    if source._mapping is not None:
        rows = rows[source._mapping]
    if rows.size and int(rows.max()) >= 2**31:
        raise ValueError(f"{source._what}: a document holds {int(rows.max())} tokens (>= 2**31)")
    return rows.astype(np.int32)
