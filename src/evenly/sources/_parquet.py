"""``evenly.from_parquet``: random access over Parquet shards, row group by row group.

>>> import os, tempfile, pyarrow as pa, pyarrow.parquet as pq
>>> d = tempfile.mkdtemp()
>>> pq.write_table(pa.table({"id": [0, 1, 2]}), os.path.join(d, "a.parquet"))
>>> pq.write_table(pa.table({"id": [3, 4]}), os.path.join(d, "b.parquet"))
>>> src = from_parquet(d, cache_dir=os.path.join(d, ".cache"))
>>> len(src), src[3], src.shard_sizes
(5, {'id': 3}, (3, 2))
>>> src.locate(4).endswith("b.parquet row 1")
True
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.core import url_to_fs

from ._base import Paths, ShardedSource
from ._manifest import FileEntry

__all__ = ["ParquetSource", "from_parquet"]

#: Decoded row groups kept per process (bytes).
DEFAULT_ROW_GROUP_CACHE = 256 << 20


class ParquetSource(ShardedSource):
    """Parquet shards as one indexable source; a sample is a dict of the row's columns.

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
        #: (shard, row group) -> (column lists, rows, Arrow bytes), least recent first
        self._groups: OrderedDict[tuple[int, int], tuple[dict[str, list[Any]], int, int]] = (
            OrderedDict()
        )
        self._group_bytes = 0
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
        return int(meta.num_rows), {"row_groups": groups, "schema": schema.to_string()}

    def _setup(self, entries: list[FileEntry]) -> None:
        first = entries[0].meta["schema"]
        for k, e in enumerate(entries):
            if e.meta["schema"] != first:
                raise ValueError(
                    f"{self._what}: the schema of shard {k} ({e.url}) differs from shard 0 "
                    f"({entries[0].url}): {_diff(first, e.meta['schema'])}; rewrite the "
                    f"shards with one schema, or open them as separate sources"
                )
            if self.columns is not None:
                names = [line.split(":")[0] for line in first.splitlines()]
                missing = [c for c in self.columns if c not in names]
                if missing:
                    raise ValueError(f"{self._what}: columns {missing} not in the schema {names}")
        self._group_starts = [
            np.concatenate([[0], np.cumsum(e.meta["row_groups"])]).astype(np.int64) for e in entries
        ]

    @property
    def preferred_shuffle(self) -> str:
        """``"block"`` for remote shards, and for local ones larger than the row-group cache
        (a global shuffle would then decode a whole row group for almost every sample);
        else ``"global"``."""
        if self.cache is not None or sum(self._shards.sizes) > self.row_group_cache_bytes:
            return "block"
        return "global"

    def _open(self, k: int, path: str) -> Any:
        return pq.ParquetFile(path)

    def _row_group(self, k: int, g: int, handle: Any) -> tuple[dict[str, list[Any]], int]:
        """Row group ``g`` of shard ``k`` as Python column lists (converted once, kept in
        an LRU: a random read is then a list lookup, not an Arrow take + conversion)."""
        key = (k, g)
        hit = self._groups.get(key)
        if hit is not None:
            self._groups.move_to_end(key)
            return hit[0], hit[1]
        table = handle.read_row_group(g, columns=self.columns)
        entry = (table.to_pydict(), table.num_rows, int(table.nbytes))
        self._groups[key] = entry
        self._group_bytes += entry[2]
        while self._group_bytes > self.row_group_cache_bytes and len(self._groups) > 1:
            _, old = self._groups.popitem(last=False)
            self._group_bytes -= old[2]
        return entry[0], entry[1]

    def _read(self, k: int, handle: Any, rows: npt.NDArray[np.int64]) -> list[Any]:
        starts = self._group_starts[k]
        groups = np.searchsorted(starts, rows, side="right") - 1
        local = rows - starts[groups]
        out: list[Any] = [None] * rows.size
        # one row-group lookup per group present, then plain list indexing per row
        for g in np.unique(groups).tolist():
            columns, num_rows = self._row_group(k, g, handle)
            expected = int(starts[g + 1] - starts[g])
            if num_rows != expected:
                raise ValueError(
                    f"row group {g} has {num_rows} rows, the manifest says {expected}: the "
                    f"file changed since it was opened"
                )
            where = np.flatnonzero(groups == g).tolist()
            picked = local[where].tolist()
            names = list(columns)
            values = [[columns[name][r] for r in picked] for name in names]
            for pos, row in zip(where, zip(*values, strict=True), strict=True):
                out[pos] = dict(zip(names, row, strict=True))
        return out

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.update(_groups=OrderedDict(), _group_bytes=0)
        return state


def _diff(a: str, b: str) -> str:
    la, lb = a.splitlines(), b.splitlines()
    for x, y in zip(la, lb, strict=False):
        if x != y:
            return f"{x.strip()!r} vs {y.strip()!r}"
    return f"{len(la)} vs {len(lb)} columns"


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
    in a per-process LRU of ``row_group_cache_bytes``).  Remote shards are downloaded
    into a bounded local cache (``cache_dir``, ``cache_bytes``) before reading.

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
