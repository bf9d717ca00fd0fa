"""What the Arrow-backed sources (Arrow IPC, Parquet) share: a batch gathered with one
Arrow ``take`` per chunk (record batch or row group), and its conversion to dict rows or
to whole columns (numpy arrays with the batch on axis 0).

Rows: numeric and bool scalars are Python scalars, strings ``str``, binary ``bytes``,
lists of numbers 1-D numpy arrays (as HF ``datasets``' numpy format gives them), anything
else what ``to_pylist`` gives.  Columns: exactly what ``default_collate`` makes of those
rows, for every column where that is possible without per-row Python objects.

>>> import pyarrow as pa
>>> t = pa.table({"x": pa.array([1, 2], pa.int32()), "v": [[1.0, 2.0], [3.0, 4.0]]})
>>> rows = to_rows(t)
>>> rows[1]["x"], rows[1]["v"].tolist()
(2, [3.0, 4.0])
>>> column_exact(pa.binary()), column_exact(pa.list_(pa.uint8(), 4))
(False, True)
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

from ._base import ShardedSource
from ._gather import LIST_VALUES, ChunkLookup, ColumnViews, chunk_views, gatherable
from ._manifest import FileEntry
from ._rowviews import RowAccess

__all__ = ["ArrowBatchSource", "column_exact", "schema_meta", "to_columns", "to_rows"]


def _scalar(t: pa.DataType) -> bool:
    return bool(pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t))


def _numeric_list(t: pa.DataType) -> bool:
    listlike = pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)
    return bool(listlike and _scalar(t.value_type))


def column_exact(t: pa.DataType) -> bool:
    """Whether :func:`to_columns` gives for a column of type ``t`` exactly what
    ``default_collate`` gives for the rows, with no per-row Python object for numbers."""
    if _scalar(t):
        return not pa.types.is_uint64(t)  # torch.tensor of ints >= 2**63 overflows
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return True
    if pa.types.is_fixed_size_list(t) and _scalar(t.value_type):
        return np.dtype(t.value_type.to_pandas_dtype()).name in LIST_VALUES
    return False


def _array(col: pa.ChunkedArray | pa.Array) -> pa.Array:
    return col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col


def _numpy(arr: pa.Array) -> npt.NDArray[Any]:
    return np.asarray(arr.to_numpy(zero_copy_only=False, writable=True))


def _list_rows(arr: pa.Array) -> list[Any]:
    """A list column as one 1-D numpy array per row (``None`` for a null row)."""
    dtype = arr.type.value_type.to_pandas_dtype()
    if arr.null_count or arr.flatten().null_count:
        return [None if v is None else np.asarray(v, dtype=dtype) for v in arr.to_pylist()]
    values = _numpy(arr.flatten())
    if pa.types.is_fixed_size_list(arr.type):
        return list(values.reshape(len(arr), arr.type.list_size))
    lengths = _numpy(pc.list_value_length(arr)).astype(np.int64)
    return np.split(values, np.cumsum(lengths)[:-1].tolist())


def _row_values(col: pa.ChunkedArray | pa.Array) -> list[Any]:
    arr = _array(col)
    if _scalar(arr.type) and not arr.null_count:
        return list(_numpy(arr).tolist())
    if _numeric_list(arr.type):
        return _list_rows(arr)
    return list(arr.to_pylist())


def to_rows(table: pa.Table) -> list[dict[str, Any]]:
    """The rows of ``table`` as dicts (see the module docstring for the value types)."""
    names = table.column_names
    values = [_row_values(table.column(i)) for i in range(table.num_columns)]
    return [dict(zip(names, row, strict=True)) for row in zip(*values, strict=True)]


def to_columns(
    table: pa.Table, samples: Sequence[int] | npt.NDArray[Any] = ()
) -> dict[str, npt.NDArray[Any] | list[Any]]:
    """The columns of ``table``: numpy arrays with the batch on axis 0 where
    :func:`column_exact` holds (ints as int64, floats as float64, bools as bool, fixed-size
    numeric lists as ``[B, L]``), ``list[str]`` for strings, and the rows' values (a list)
    for any other column.  A null in a numeric column raises, naming the column and the
    sample (``samples[j]`` for row ``j``), as ``default_collate`` cannot stack ``None``."""
    out: dict[str, npt.NDArray[Any] | list[Any]] = {}
    for name in table.column_names:
        arr = _array(table.column(name))
        t = arr.type
        if column_exact(t) and (_scalar(t) or pa.types.is_fixed_size_list(t)):
            if arr.null_count or (not _scalar(t) and arr.flatten().null_count):
                raise _null_error(name, arr, samples)
            if _scalar(t):
                values = _numpy(arr)
                kind = values.dtype.kind
                out[name] = values.astype(
                    np.bool_ if kind == "b" else np.float64 if kind == "f" else np.int64, copy=False
                )
            else:
                out[name] = _numpy(arr.flatten()).reshape(len(arr), t.list_size)
        else:
            out[name] = _row_values(arr)
    return out


def _null_error(name: str, arr: pa.Array, samples: Sequence[int] | npt.NDArray[Any]) -> ValueError:
    rows = arr.to_pylist()
    j = next(i for i, v in enumerate(rows) if v is None or (isinstance(v, list) and None in v))
    sample = int(samples[j]) if len(samples) > j else j
    return ValueError(
        f"column {name!r} holds a null (row {j} of the batch, sample {sample}); a null "
        f"cannot be stacked into a tensor: fill it, or read rows instead"
    )


def schema_meta(schema: pa.Schema) -> dict[str, str]:
    """What a manifest entry keeps of a file's schema: its text (compared across files)
    and the schema itself, serialised."""
    packed = base64.b64encode(schema.serialize().to_pybytes()).decode("ascii")
    return {"schema": schema.to_string(), "arrow_schema": packed}


def _first_difference(a: str, b: str) -> str:
    la, lb = a.splitlines(), b.splitlines()
    for x, y in zip(la, lb, strict=False):
        if x != y:
            return f"{x.strip()!r} vs {y.strip()!r}"
    return f"{len(la)} vs {len(lb)} columns"


class ArrowBatchSource(ShardedSource):
    """A sharded source whose shards are split into Arrow chunks (record batches, row
    groups): a batch is read with one lookup for the whole batch and one ``take`` per
    chunk present.  Subclasses set ``self.schema`` and ``self._chunk_rows`` (rows per chunk,
    one list per shard) in ``_setup`` and define ``_chunk(k, g, handle)``; they may set
    ``self._mapping`` (sample -> row, e.g. HF datasets' indices mapping)."""

    schema: pa.Schema
    _chunk_rows: list[list[int]]
    _mapping: npt.NDArray[np.int64] | None = None
    _mapping_id: str = ""

    def _chunk(self, k: int, g: int, handle: Any) -> pa.Table | pa.RecordBatch:
        raise NotImplementedError

    columns: list[str] | None = None
    _gatherable = False  #: every column fixed-width numbers (set with the schema)

    def _setup_chunks(self, entries: list[FileEntry], chunks: str) -> None:
        """One schema for all files (the selected ``columns`` of it) and each file's rows
        per chunk (``meta[chunks]``), from the manifest entries."""
        first = entries[0].meta["schema"]
        for k, e in enumerate(entries):
            if e.meta["schema"] != first:
                raise ValueError(
                    f"{self._what}: the schema of shard {k} ({e.url}) differs from shard 0 "
                    f"({entries[0].url}): {_first_difference(first, e.meta['schema'])}; "
                    f"rewrite the shards with one schema, or open them as separate sources"
                )
        packed = entries[0].meta.get("arrow_schema")
        if packed is None:  # a manifest written before the schema was kept in it
            packed = self._scan(0, self.urls[0])[1]["arrow_schema"]
        schema = pa.ipc.read_schema(pa.py_buffer(base64.b64decode(packed)))
        if self.columns is not None:
            missing = [c for c in self.columns if c not in schema.names]
            if missing:
                raise ValueError(
                    f"{self._what}: columns {missing} not in the schema {schema.names}"
                )
            schema = pa.schema([schema.field(c) for c in self.columns])
        self.schema = schema
        self._gatherable = gatherable(schema)
        self._chunk_rows = [[int(n) for n in e.meta[chunks]] for e in entries]
        self._index_chunks()

    def _index_chunks(self) -> None:
        """Global chunk starts, and the lookup that finds every sample's chunk."""
        sizes = [n for rows in self._chunk_rows for n in rows]
        self._cstarts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)]).astype(np.int64)
        self._chunk_of = ChunkLookup(self._cstarts)
        self._cshard = np.repeat(
            np.arange(len(self._chunk_rows), dtype=np.int64), [len(r) for r in self._chunk_rows]
        )
        self._clocal = np.concatenate(
            [np.arange(len(r), dtype=np.int64) for r in self._chunk_rows] or [np.zeros(0, np.int64)]
        )
        for k, rows in enumerate(self._chunk_rows):
            if sum(rows) != self._sizes[k]:
                raise ValueError(
                    f"{self._what}: shard {k} ({self.urls[k]}) lists {sum(rows)} rows in its "
                    f"chunks but {self._sizes[k]} in all; the manifest is stale: reopen with "
                    f"use_manifest=False"
                )

    # ---- the Source protocol, through the optional mapping ---------------------------
    def __len__(self) -> int:
        return len(self._mapping) if self._mapping is not None else super().__len__()

    @property
    def shard_sizes(self) -> tuple[int, ...]:
        """Samples per shard; with an indices mapping, the samples split evenly over as
        many blocks as there are files (any split is valid for the block shuffle)."""
        if self._mapping is None:
            return self._sizes
        n, k = len(self._mapping), len(self._sizes)
        return tuple(int(x) for x in np.diff(np.linspace(0, n, k + 1).astype(np.int64)))

    @property
    def fingerprint(self) -> str:
        base = super().fingerprint
        return base if self._mapping is None else f"{base}:indices:{len(self)}:{self._mapping_id}"

    def content_key(self) -> str:
        """The files' identities, and the indices mapping's: an HF dataset's fingerprint,
        else a digest of the mapping itself."""
        base = super().content_key()
        if self._mapping is None:
            return base
        mapping = self._mapping_id or hashlib.sha256(self._mapping.tobytes()).hexdigest()[:32]
        return f"{base}:indices:{len(self)}:{mapping}"

    def token_lengths(self, field: str) -> npt.NDArray[np.int32]:
        """Tokens per sample of the list column ``field`` (packing's lengths), read from
        the list offsets."""
        from evenly.sources._lengths import list_lengths

        return list_lengths(self, field)

    def read_tokens(self, indices: Sequence[int], field: str) -> list[npt.NDArray[Any]]:
        """The token ids of the list column ``field`` for each of ``indices``: one numpy
        slice per document (packing's reads; no row dicts)."""
        from evenly.sources._tokens import list_tokens

        return list_tokens(self, indices, field)

    def _token_views(self, k: int, g: int, handle: Any, field: str) -> Any:
        """Chunk ``g`` of shard ``k``'s list column ``field`` as (values, offsets)."""
        from evenly.sources._tokens import token_views

        return token_views(self._chunk(k, g, handle), field)

    def _rows(self, idx: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        return idx if self._mapping is None else self._mapping[idx]

    def locate(self, index: int) -> str:
        (row,) = self._rows(self._check_indices([index])).tolist()
        k = int(np.searchsorted(self._starts, row, side="right") - 1)
        return f"{self.urls[k]} row {row - int(self._starts[k])}"

    def prefetch(self, indices: Sequence[int]) -> None:
        if self.cache is None or not len(indices):
            return
        rows = self._rows(self._check_indices(indices))
        shards = np.searchsorted(self._starts, rows, side="right") - 1
        _, first = np.unique(shards, return_index=True)
        self._prefetch_shards(shards[np.sort(first)].tolist())

    def _prefetch_shards(self, shards: list[int], now: bool = False) -> None:
        """Start downloading these shards (remote only), in this order (``now``: the
        batch being read needs them, ahead of the look-ahead)."""
        if self.cache is None:
            return
        self.cache.prefetch((self._remote(k) for k in shards), now=now)

    def _chunks_read(self, rows: npt.NDArray[np.int64]) -> None:
        """Called after a read of ``rows`` (source rows) succeeded: :meth:`_chunk_read` for
        each chunk, where a subclass defines it (one that keeps chunks per process may
        release those it was told it will not read again)."""
        if not rows.size or type(self)._chunk_read is ArrowBatchSource._chunk_read:
            return
        chunks, counts = np.unique(self._chunk_of.of(rows), return_counts=True)
        for c, n in zip(chunks.tolist(), counts.tolist(), strict=True):
            self._chunk_read(c, n)

    # ---- batched reads -----------------------------------------------------------------
    def take(self, indices: Sequence[int] | npt.NDArray[Any]) -> pa.Table:
        """The samples ``indices`` as one Arrow table, in the order asked."""
        samples = self._check_indices(indices)
        table = self._take(samples)
        self._chunks_read(self._rows(samples))
        return table

    def _take(self, samples: npt.NDArray[np.int64]) -> pa.Table:
        rows = self._rows(samples)
        if not rows.size:
            return self.schema.empty_table()
        chunk = self._chunk_of.of(rows)
        order = np.argsort(chunk, kind="stable")
        present, first = np.unique(chunk[order], return_index=True)
        if present.size > 1:
            self._prefetch_shards(np.unique(self._cshard[present]).tolist(), now=True)
        bounds = [*first.tolist(), rows.size]
        pieces = []
        for j, c in enumerate(present.tolist()):
            where = order[bounds[j] : bounds[j + 1]]
            k, g = int(self._cshard[c]), int(self._clocal[c])
            try:
                part = self._chunk(k, g, self._handle(k)).take(
                    pa.array(rows[where] - self._cstarts[c])
                )
            except Exception as exc:
                raise self._error(exc, int(samples[where[0]])) from exc
            if isinstance(part, pa.RecordBatch):
                part = pa.Table.from_batches([part])
            pieces.append(part.replace_schema_metadata(None))
        table = pa.concat_tables(pieces)
        if present.size == 1 and bool(np.all(order[1:] > order[:-1])):
            return table
        inverse = np.empty_like(order)
        inverse[order] = np.arange(order.size)
        return table.take(pa.array(inverse))

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """Read a batch as dict rows: one lookup for the whole batch, then each row from
        its chunk's per-row accessors (or, for a chunk with nulls or other column types,
        one Arrow ``take`` per chunk present).  The chunks this read finishes
        (:meth:`_finishing`) are read first, their rows taken out at once, and reported
        read (:meth:`_chunk_read`) before the next chunk is read."""
        samples = self._check_indices(indices)
        rows = self._rows(samples)
        chunk = self._chunk_of.of(rows)
        present = np.unique(chunk)
        if present.size > 1 and self.cache is not None:
            self._prefetch_shards(np.unique(self._cshard[present]).tolist(), now=True)
        finishing = self._finishing(chunk, present)
        if finishing:  # those first
            first = np.isin(present, list(finishing))
            present = np.concatenate([present[first], present[~first]])
        local = (rows - self._cstarts[chunk]).tolist()
        row_of: dict[int, Any] = {}  # chunk -> its accessors' row()
        ks, gs = self._cshard[present].tolist(), self._clocal[present].tolist()
        where = zip(present.tolist(), ks, gs, strict=True)
        handle, last = None, -1  # a shard's chunks are consecutive: its handle once
        for c, k, g in where:
            try:
                if k != last:
                    handle, last = self._handle(k), k
                found = self._row_access(k, g, handle)
            except Exception as exc:
                raise self._error(exc, int(samples[int(np.argmax(chunk == c))])) from exc
            if found is None:  # the whole batch the general way
                table = self._take(samples)
                counted = [x for x in row_of if x in finishing]
                self._chunks_read(rows[~np.isin(chunk, counted)])  # not counted yet
                return to_rows(table)
            row_of[c] = found.row
            if c in finishing:  # its rows out now, then the chunk may go
                mine = np.flatnonzero(chunk == c)
                values = {i: found.row(i) for i in {local[j] for j in mine.tolist()}}
                row_of[c] = values.__getitem__
                self._chunk_read(c, int(mine.size))
        out = [row_of[c](i) for c, i in zip(chunk.tolist(), local, strict=True)]
        self._chunks_read(rows[~np.isin(chunk, list(finishing))] if finishing else rows)
        return out

    def _finishing(self, chunk: npt.NDArray[np.int64], present: npt.NDArray[np.int64]) -> set[int]:
        """The chunks (of ``present``) that this read of rows in ``chunk`` finishes; here
        none (a subclass that releases chunks as they are read names them)."""
        return set()

    def _chunk_read(self, c: int, n: int) -> None:
        """``n`` rows of chunk ``c`` (global chunk number) were just read."""

    def _row_access(self, k: int, g: int, handle: Any) -> RowAccess | None:
        """The per-row accessors of chunk ``g`` of shard ``k`` (subclasses keep them with
        the chunk, so they never outlive it)."""
        return RowAccess.of(self._chunk(k, g, handle))

    def __getitem__(self, index: int) -> Any:
        return self.__getitems__([index])[0]

    def read_columns(
        self, indices: Sequence[int] | npt.NDArray[Any]
    ) -> dict[str, npt.NDArray[Any] | list[Any]]:
        """A whole batch as columns: ``torch.from_numpy(out[name])`` equals
        ``default_collate([self[i] for i in indices])[name]`` for every column where
        :attr:`columnar_exact` holds (see :func:`to_columns`).  When every column is a
        fixed-width number (or a fixed-size list of them) with no nulls, each column is
        gathered with one numpy fancy index over the chunks in use; otherwise one Arrow
        ``take`` per chunk."""
        idx = self._check_indices(indices)
        out: dict[str, npt.NDArray[Any] | list[Any]] | None = None
        if self._gatherable:
            gathered = self._gather(idx)
            if gathered is not None:
                out = dict(gathered)
        if out is None:
            out = to_columns(self._take(idx), idx)
        self._chunks_read(self._rows(idx))
        return out

    def _gather(self, samples: npt.NDArray[np.int64]) -> dict[str, npt.NDArray[Any]] | None:
        rows = self._rows(samples)
        chunk = self._chunk_of.of(rows)
        present = np.unique(chunk)
        if not present.size:
            return None
        views = []
        for c in present.tolist():
            k, g = int(self._cshard[c]), int(self._clocal[c])
            try:
                found = self._chunk_views(k, g, self._handle(k))
            except Exception as exc:
                raise self._error(exc, int(samples[int(np.argmax(chunk == c))])) from exc
            if found is None:
                return None
            views.append(found)
        window = ColumnViews(list(self.schema.names), views)
        return window.gather(np.searchsorted(present, chunk), rows - self._cstarts[chunk])

    def _chunk_views(self, k: int, g: int, handle: Any) -> list[npt.NDArray[Any]] | None:
        """Numpy views of chunk ``g`` of shard ``k``'s columns (None: not gatherable)."""
        return chunk_views(self._chunk(k, g, handle))

    @property
    def columnar_exact(self) -> bool:
        """True when :meth:`read_columns` equals ``default_collate`` of the rows for every
        column (numbers, bools, strings, fixed-size numeric lists); False if some column is
        binary, a variable-length list, a struct..."""
        return all(column_exact(f.type) for f in self.schema)
