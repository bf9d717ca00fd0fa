"""``evenly.from_parquet``: random access over Parquet shards, row group by row group.

Decoded row groups stay Arrow tables in a per-process LRU budgeted by their real buffer
size; a batch is one lookup for the whole batch and one ``take`` per row group present.

>>> import os, tempfile, pyarrow as pa, pyarrow.parquet as pq
>>> d = tempfile.mkdtemp()
>>> pq.write_table(pa.table({"id": [0, 1, 2]}), os.path.join(d, "a.parquet"))
>>> pq.write_table(pa.table({"id": [3, 4]}), os.path.join(d, "b.parquet"))
>>> src = from_parquet(d, cache_dir=os.path.join(d, ".cache"))
>>> len(src), src[3], src.shard_sizes
(5, {'id': 3}, (3, 2))
>>> src.locate(4).endswith("b.parquet row 1")
True
>>> src.read_columns([4, 0])["id"].tolist()
[4, 0]
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy.typing as npt
import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.core import url_to_fs

from ._base import Paths
from ._columns import ArrowBatchSource, schema_meta
from ._gather import chunk_views
from ._manifest import FileEntry
from ._rowviews import RowAccess

__all__ = ["ParquetSource", "from_parquet"]

#: Decoded row groups kept per process (bytes of Arrow buffers).
DEFAULT_ROW_GROUP_CACHE = 256 << 20


class ParquetSource(ArrowBatchSource):
    """Parquet shards as one indexable source; a sample is a dict of the row's columns
    (numbers as Python scalars, lists of numbers as 1-D numpy arrays), and
    :meth:`read_columns` reads a whole batch as numpy columns.

    Build it with :func:`from_parquet`.
    """

    format = "parquet"
    extensions = (".parquet", ".parq", ".pq")

    def __init__(
        self,
        paths: Paths,
        *,
        columns: Sequence[str] | None = None,
        row_group_cache_bytes: int = DEFAULT_ROW_GROUP_CACHE,
        **kwargs: Any,
    ) -> None:
        self.columns = None if columns is None else list(columns)
        self.row_group_cache_bytes = int(row_group_cache_bytes)
        #: (shard, row group) -> (Arrow table, its buffer bytes), least recent first
        self._groups: OrderedDict[tuple[int, int], tuple[pa.Table, int]] = OrderedDict()
        self._group_bytes = 0
        #: per-row accessors of the row groups in the LRU (evicted with them)
        self._group_access: dict[tuple[int, int], RowAccess | None] = {}
        #: numpy views of their columns (zero-copy; evicted with them)
        self._group_views: dict[tuple[int, int], list[npt.NDArray[Any]] | None] = {}
        super().__init__(paths, **kwargs)

    def _scan(self, k: int, url: str) -> tuple[int, dict[str, Any]]:
        fs, path = url_to_fs(url, **self._shards.storage_options)
        with fs.open(path, "rb", size=self._shards.sizes[k]) as f:
            head = f.read(4)
            if head != b"PAR1":
                raise ValueError(
                    f"it is not a Parquet file (it starts with {head!r}, not b'PAR1'); "
                    f"is the extension wrong?"
                )
            try:
                meta = pq.ParquetFile(f).metadata
            except (pa.ArrowInvalid, OSError) as exc:
                raise ValueError(f"truncated or corrupt Parquet file: {exc}") from exc
            groups = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
            schema = meta.schema.to_arrow_schema().remove_metadata()
        return int(meta.num_rows), {"row_groups": groups, **schema_meta(schema)}

    def _setup(self, entries: list[FileEntry]) -> None:
        self._setup_chunks(entries, "row_groups")

    def shuffle_advice(self, mode: str) -> str | None:
        """A word for the user when the global shuffle will decode a row group for
        almost every sample (local data larger than the row-group cache)."""
        data = sum(self._shards.sizes)
        if mode != "global" or self.cache is not None or data <= self.row_group_cache_bytes:
            return None
        return (
            f"evenly.from_parquet: a global shuffle over {data >> 20} MiB of Parquet with a "
            f"{self.row_group_cache_bytes >> 20} MiB row-group cache decodes a row group for "
            f"almost every sample (slow); use shuffle='block', Arrow files "
            f"(evenly.write(..., format='arrow')), smaller row groups, or a larger "
            f"row_group_cache_bytes"
        )

    def _open(self, k: int, path: str) -> Any:
        return pq.ParquetFile(path)

    def _chunk(self, k: int, g: int, handle: Any) -> pa.Table:
        """Row group ``g`` of shard ``k`` as an Arrow table: from the LRU (budgeted by the
        tables' real buffer sizes, so the budget is the memory held) or decoded now."""
        key = (k, g)
        hit = self._groups.get(key)
        if hit is not None:
            self._groups.move_to_end(key)
            self._count(cache_hits=1)
            return hit[0]
        started = time.perf_counter()
        table = handle.read_row_group(g, columns=self.columns)
        decoded = time.perf_counter() - started
        expected = self._chunk_rows[k][g]
        if table.num_rows != expected:
            raise ValueError(
                f"row group {g} has {table.num_rows} rows, the manifest says {expected}: the "
                f"file changed since it was opened"
            )
        size = int(table.get_total_buffer_size())
        self._count(cache_misses=1, bytes_decoded=size, decode_seconds=decoded)
        self._groups[key] = (table, size)
        self._group_bytes += size
        self._evict()
        return table

    def _evict(self) -> None:
        while self._group_bytes > self.row_group_cache_bytes and len(self._groups) > 1:
            key, old = self._groups.popitem(last=False)
            self._group_bytes -= old[1]
            self._group_access.pop(key, None)
            self._group_views.pop(key, None)

    def _chunk_views(self, k: int, g: int, handle: Any) -> list[npt.NDArray[Any]] | None:
        """A row group's column views, kept with its table (they hold no other memory;
        ``_chunk`` has just made the row group the newest entry of the LRU)."""
        key = (k, g)
        table = self._chunk(k, g, handle)
        if key not in self._group_views:
            self._group_views[key] = chunk_views(table)
        return self._group_views[key]

    def _row_access(self, k: int, g: int, handle: Any) -> RowAccess | None:
        """A row group's per-row accessors, kept and counted with its table."""
        key = (k, g)
        table = self._chunk(k, g, handle)
        if key in self._group_access:
            return self._group_access[key]
        access = RowAccess.of(table)
        extra = access.nbytes if access is not None else 0
        self._groups[key] = (table, self._groups[key][1] + extra)
        self._group_bytes += extra
        self._group_access[key] = access
        self._evict()  # never the newest entry: this one
        return access

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.update(_groups=OrderedDict(), _group_bytes=0, _group_access={}, _group_views={})
        return state


def from_parquet(
    paths: Paths,
    *,
    columns: Sequence[str] | None = None,
    storage_options: dict[str, Any] | None = None,
    cache_dir: str | None = None,
    cache_bytes: int | None = None,
    row_group_cache_bytes: int = DEFAULT_ROW_GROUP_CACHE,
    use_manifest: bool = True,
) -> ParquetSource:
    """A source over Parquet shards: a list, a glob, a directory or an fsspec URL.

    Random access reads only the row group holding a sample (decoded row groups are kept
    as Arrow tables in a per-process LRU of ``row_group_cache_bytes``).  ``shuffle=True``
    means a global shuffle for local shards whatever their size (so the order never
    depends on the cache setting) and a block shuffle for remote ones.  Remote shards are
    downloaded into a bounded local cache (``cache_dir``, ``cache_bytes``) before reading.

    >>> import evenly
    >>> ds = evenly.Dataset(from_parquet("data/*.parquet"), shuffle=True)  # doctest: +SKIP
    """
    return ParquetSource(
        paths,
        columns=columns,
        storage_options=storage_options,
        cache_dir=cache_dir,
        cache_bytes=cache_bytes,
        row_group_cache_bytes=row_group_cache_bytes,
        use_manifest=use_manifest,
    )
