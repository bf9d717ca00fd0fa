"""``evenly.from_arrow``: Arrow IPC files (file or stream format), memory-mapped.

Any sample is a row: one lookup for the batch and one ``take`` per record batch present,
straight from the memory map (no decode, no per-worker cache: the OS page cache is
shared by every worker and rank on a node).  It also opens the Arrow files of a HF
``datasets`` Dataset: a ``save_to_disk`` directory, or a loaded ``datasets.Dataset``
object (its cache files), honouring its indices mapping (``select``, ``filter``,
``shuffle``...).

>>> import os, tempfile, pyarrow as pa
>>> d = tempfile.mkdtemp()
>>> with pa.ipc.new_file(os.path.join(d, "a.arrow"), pa.schema([("id", pa.int64())])) as w:
...     w.write_table(pa.table({"id": [0, 1, 2]}), max_chunksize=2)
>>> src = from_arrow(d, cache_dir=os.path.join(d, ".cache"))
>>> len(src), src[2], src.read_columns([2, 0])["id"].tolist()
(3, {'id': 2}, [2, 0])
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from ._base import Paths
from ._columns import ArrowBatchSource, schema_meta
from ._gather import ColumnViews, chunk_views
from ._manifest import FileEntry
from ._rowviews import RowAccess
from ._tokens import TokenSpan, arrow_token_ranges

__all__ = ["ArrowSource", "from_arrow"]

_FILE_MAGIC = b"ARROW1"


class _Mapped:
    """An open Arrow file: its memory map and its record batches (zero-copy views)."""

    def __init__(self, path: str, columns: list[str] | None) -> None:
        self.path = path
        self.map = pa.memory_map(path)
        self.fd = self.map.fileno()
        st = os.fstat(self.fd)
        self.identity = (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
        if self.map.read(6) == _FILE_MAGIC:
            self.map.seek(0)
            reader = pa.ipc.open_file(self.map)
            batches = [reader.get_batch(i) for i in range(reader.num_record_batches)]
        else:
            self.map.seek(0)
            batches = list(pa.ipc.open_stream(self.map))
        self.batches = [b if columns is None else b.select(columns) for b in batches]
        #: per record batch, made on first use: row accessors and column views
        self.access: dict[int, RowAccess | None] = {}
        self.views: dict[int, list[npt.NDArray[Any]] | None] = {}
        #: per (record batch, list column): token values and offsets (packing's reads)
        self.tokens: dict[tuple[int, str], Any] = {}

    def check(self) -> None:
        """Raise if the mapped file was rewritten or truncated in place since it was
        mapped (reading a truncated map kills the process with SIGBUS)."""
        st = os.fstat(self.fd)
        if (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino) != self.identity:
            raise ValueError(
                f"{self.path} changed while it was mapped ({self.identity[0]} bytes when "
                f"opened, {st.st_size} now): it was rewritten in place; open the source again"
            )

    def close(self) -> None:
        self.batches, self.access, self.views, self.tokens = [], {}, {}, {}
        self.map.close()


class ArrowSource(ArrowBatchSource):
    """Arrow IPC files as one indexable source; a sample is a dict of the row's columns
    (numbers as Python scalars, lists of numbers as 1-D numpy arrays), and
    :meth:`read_columns` reads a whole batch as numpy columns.

    Build it with :func:`from_arrow`.
    """

    format = "arrow"
    extensions = (".arrow", ".feather", ".ipc")

    def __init__(
        self,
        paths: Paths,
        *,
        columns: Sequence[str] | None = None,
        mapping: npt.NDArray[np.int64] | None = None,
        mapping_id: str = "",
        **kwargs: Any,
    ) -> None:
        self.columns = None if columns is None else list(columns)
        super().__init__(paths, **kwargs)
        if mapping is not None:
            rows = int(self._starts[-1])
            bad = np.flatnonzero((mapping < 0) | (mapping >= rows))
            if bad.size:
                raise ValueError(
                    f"{self._what}: the indices mapping sends sample {int(bad[0])} to row "
                    f"{int(mapping[bad[0]])}, but the files hold {rows} rows; the mapping "
                    f"belongs to other files"
                )
            self._mapping = mapping
            self._mapping_id = mapping_id

    def _scan(self, k: int, url: str) -> tuple[int, dict[str, Any]]:
        try:
            mapped = _Mapped(self.local_path(k), None)
        except (pa.ArrowInvalid, OSError) as exc:
            if isinstance(exc, FileNotFoundError):
                raise
            raise ValueError(
                f"it is not a readable Arrow IPC file or stream ({exc}); is it truncated, "
                f"or is the extension wrong?"
            ) from exc
        try:
            rows = [b.num_rows for b in mapped.batches]
            if mapped.batches:
                schema = mapped.batches[0].schema
            else:
                mapped.map.seek(0)
                head = mapped.map.read(6)
                mapped.map.seek(0)
                schema = (
                    pa.ipc.open_file(mapped.map).schema
                    if head == _FILE_MAGIC
                    else pa.ipc.open_stream(mapped.map).schema
                )
        finally:
            mapped.close()
        schema = schema.remove_metadata()
        return sum(rows), {"batches": rows, **schema_meta(schema)}

    def _setup(self, entries: list[FileEntry]) -> None:
        self._setup_chunks(entries, "batches")

    def _open(self, k: int, path: str) -> Any:
        mapped = _Mapped(path, self.columns)
        rows = [b.num_rows for b in mapped.batches]
        if rows != self._chunk_rows[k]:
            mapped.close()
            raise ValueError(
                f"{self._what}: {self.urls[k]} now holds record batches of {rows[:8]} rows, "
                f"the manifest says {self._chunk_rows[k][:8]}: the file changed since it was "
                f"opened; open the source again"
            )
        return mapped

    def _handle(self, k: int) -> Any:
        """The open file, checked unchanged before every read from it."""
        handle = super()._handle(k)
        handle.check()
        return handle

    def _chunk(self, k: int, g: int, handle: Any) -> pa.RecordBatch:
        batch: pa.RecordBatch = handle.batches[g]
        return batch

    def _row_access(self, k: int, g: int, handle: Any) -> RowAccess | None:
        """Kept on the open file (closed with it by the handle LRU)."""
        if g not in handle.access:
            handle.access[g] = RowAccess.of(handle.batches[g])
        found: RowAccess | None = handle.access[g]
        return found

    def _chunk_views(self, k: int, g: int, handle: Any) -> list[npt.NDArray[Any]] | None:
        """Kept on the open file (closed with it by the handle LRU)."""
        if g not in handle.views:
            handle.views[g] = chunk_views(handle.batches[g])
        found: list[npt.NDArray[Any]] | None = handle.views[g]
        return found

    def _token_views(self, k: int, g: int, handle: Any, field: str) -> Any:
        """Kept on the open file (views of its memory map, closed with it)."""
        key = (g, field)
        if key not in handle.tokens:
            handle.tokens[key] = super()._token_views(k, g, handle, field)
        return handle.tokens[key]

    def read_column_batches(
        self, batches: Sequence[Sequence[int] | npt.NDArray[Any]]
    ) -> list[dict[str, npt.NDArray[Any] | list[Any]]]:
        """Several batches in one call: item ``j`` equals ``read_columns(batches[j])``,
        with one chunk lookup and one check of each file in use for all of them (the
        batches are views of one gather's arrays)."""
        whole = self._check_indices(np.concatenate(batches)) if len(batches) > 1 else None
        if whole is not None:
            bounds = np.cumsum([len(b) for b in batches])[:-1].tolist()
            parts = np.split(whole, bounds)
        else:
            parts = [self._check_indices(b) for b in batches]
        found = self._gather_many(parts) if self._gatherable and parts else None
        if found is None:
            return [self.read_columns(p) for p in parts]
        return [dict(columns) for columns in found]

    def _gather(self, samples: npt.NDArray[np.int64]) -> dict[str, npt.NDArray[Any]] | None:
        found = self._gather_many([samples])
        return None if found is None else found[0]

    def _gather_many(
        self, parts: list[npt.NDArray[np.int64]]
    ) -> list[dict[str, npt.NDArray[Any]]] | None:
        """Local files that all fit among the open files: one window over every record
        batch of every file, made once per process (no per-batch setup); each file the
        batches read is checked unchanged once, just before they are read."""
        if self.cache is not None or len(self.urls) > self.max_open_files:
            many = [super(ArrowSource, self)._gather(p) for p in parts]
            return None if any(g is None for g in many) else many  # type: ignore[return-value]
        if self.__dict__.get("_window_pid") != os.getpid():
            chunks, files = [], []
            for k in range(len(self.urls)):
                handle = self._handle(k)
                for g in range(len(handle.batches)):
                    chunks.append(self._chunk_views(k, g, handle))
                    files.append(k)
            ready = [c for c in chunks if c is not None]
            names = list(self.schema.names)
            self._window = ColumnViews(names, ready) if len(ready) == len(chunks) else None
            self._window_files = np.array(files, dtype=np.int64)  # chunk -> file
            self._window_handles = list(self._handles.get(k) for k in range(len(self.urls)))
            self._window_pid = os.getpid()
        window: ColumnViews | None = self._window
        if window is None:
            return None
        rows = self._rows(np.concatenate(parts) if len(parts) > 1 else parts[0])
        chunk = self._chunk_of.of(rows)
        if not self._unchanged(self._window_files[chunk], self._window_handles):
            self._window_pid = -1  # the files were closed since: map them again
            return self._gather_many(parts)
        local = rows - self._cstarts[chunk]
        whole = window.gather_group(chunk, local)  # one gather per column, every batch
        out, lo = [], 0
        for p in parts:
            out.append({name: column[lo : lo + p.size] for name, column in whole.items()})
            lo += p.size
        return out

    def token_ranges(
        self, indices: npt.NDArray[np.int64], field: str
    ) -> tuple[TokenSpan, npt.NDArray[np.int64], npt.NDArray[np.int64]] | None:
        """Packing's fast read of documents ``indices``: the column's :class:`TokenSpan`,
        where each document starts in it and how many tokens it holds (each file they are
        in checked unchanged, just before); None where documents are read one by one
        (remote files, more files than stay open, nulls, mixed dtypes)."""
        if self.cache is not None or len(self.urls) > self.max_open_files:
            return None
        return arrow_token_ranges(self, indices, field)

    def _unchanged(self, files: npt.NDArray[np.int64], built: list[Any]) -> bool:
        """Check each of ``files`` unchanged (raising if one was rewritten); False if one
        was closed since ``built`` (its handles) was made, so views of it are stale."""
        used = np.bincount(files, minlength=len(self.urls))  # (np.unique imports numpy.ma)
        for k in np.flatnonzero(used).tolist():
            handle = self._handles.get(k)
            if handle is None or handle is not built[k]:
                return False
            handle.check()
        return True

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.pop("_spans", None)
        state.pop("_spans_pid", None)
        state.pop("_window", None)
        state.pop("_window_pid", None)
        state.pop("_window_files", None)
        state.pop("_window_handles", None)
        return state


def _hf_directory(path: str) -> tuple[list[str], npt.NDArray[np.int64] | None, str]:
    """The data files (and the indices mapping, if any) of a ``save_to_disk`` directory."""
    if os.path.exists(os.path.join(path, "dataset_dict.json")):
        splits = sorted(d for d in os.listdir(path) if os.path.isdir(os.path.join(path, d)))
        raise ValueError(
            f"evenly.from_arrow: {path!r} holds a datasets.DatasetDict (splits {splits}); "
            f"pass one split's directory, e.g. {os.path.join(path, (splits or ['train'])[0])!r}"
        )
    with open(os.path.join(path, "state.json"), encoding="utf-8") as f:
        state = json.load(f)
    files = [os.path.join(path, d["filename"]) for d in state.get("_data_files", [])]
    if not files:
        raise ValueError(f"evenly.from_arrow: {path}/state.json lists no data files")
    mapping = None
    indices = state.get("_indices_data_files") or []
    if indices:  # written by an old `datasets` that kept select/filter/shuffle unapplied
        parts = [_Mapped(os.path.join(path, d["filename"]), None) for d in indices]
        try:
            mapping = np.concatenate(
                [b.column(0).to_numpy().astype(np.int64) for p in parts for b in p.batches]
            )
        finally:
            for p in parts:
                p.close()
    return files, mapping, str(state.get("_fingerprint", ""))


def _hf_dataset(
    ds: Any, columns: list[str] | None
) -> tuple[list[str], npt.NDArray[np.int64] | None, str, list[str]]:
    """The cache files, indices mapping, fingerprint and columns of a ``datasets.Dataset``."""
    # the user has `datasets` (ds is one of its objects); it is never a dependency of evenly
    from datasets.table import list_table_cache_files  # type: ignore[import-untyped]

    files = list(list_table_cache_files(ds._data))  # not the indices mapping's file
    if not files:
        raise ValueError(
            "evenly.from_arrow: this datasets.Dataset is held in memory (it has no cache "
            "files); save it with ds.save_to_disk(path) and pass that directory, or use "
            "the Dataset itself as a map-style source"
        )
    names = list(ds._data.column_names)
    chosen = names if columns is None else list(columns)
    missing = [c for c in chosen if c not in names]
    if missing:
        raise ValueError(f"evenly.from_arrow: columns {missing} not in the dataset's {names}")
    mapped = _Mapped(files[0], None)
    try:
        on_disk = mapped.batches[0].schema.names if mapped.batches else chosen
    finally:
        mapped.close()
    renamed = [c for c in chosen if c not in on_disk]
    if renamed:
        raise ValueError(
            f"evenly.from_arrow: the dataset's columns {renamed} are not in its cache files "
            f"(columns {on_disk}): renamed or added in memory; write it out with "
            f"ds.save_to_disk(path) and pass that directory"
        )
    mapping = None
    if ds._indices is not None:
        mapping = np.asarray(ds._indices.column(0).to_numpy(), dtype=np.int64)
    return files, mapping, str(getattr(ds, "_fingerprint", "")), chosen


def _check_hf_table(source: ArrowSource, ds: Any) -> None:
    """Refuse a Dataset whose table differs from its cache files (an in-memory slice,
    rename or cast that the files do not hold): reading the files would return other
    rows or columns than the dataset shows."""
    rows = int(source._starts[-1])
    wanted = ds._data.schema.remove_metadata()
    wanted = pa.schema([wanted.field(n) for n in source.schema.names])
    if rows != ds._data.num_rows or not wanted.equals(source.schema.remove_metadata()):
        raise ValueError(
            f"evenly.from_arrow: the datasets.Dataset differs from its cache files "
            f"({ds._data.num_rows} rows and schema {wanted.names} vs {rows} rows and "
            f"{source.schema.names} on disk: an in-memory select of a range, rename or "
            f"cast); write it out with ds.save_to_disk(path) and pass that directory"
        )


def from_arrow(
    paths: Paths | Any,
    *,
    columns: Sequence[str] | None = None,
    storage_options: dict[str, Any] | None = None,
    cache_dir: str | None = None,
    cache_bytes: int | None = None,
    max_in_flight: int | None = None,
    use_manifest: bool = True,
) -> ArrowSource:
    """A source over Arrow IPC files (``.arrow``, ``.feather``, ``.ipc``; file or stream
    format): a list, a glob, a directory or an fsspec URL; also a HF ``datasets``
    ``save_to_disk`` directory or a loaded ``datasets.Dataset`` (its cache files).

    Local files are memory-mapped: a global shuffle costs no more than a sequential read
    once the pages are cached, so ``shuffle=True`` is a global shuffle for local files.
    Remote files are downloaded whole into the bounded shard cache (``cache_dir``,
    ``cache_bytes``; at most ``max_in_flight`` requests in flight per node, default
    ``$EVENLY_MAX_IN_FLIGHT``, else 16) first.  A Dataset's indices mapping (from
    ``select``, ``filter``, ``shuffle``, ``train_test_split``) is honoured: sample ``i``
    is the dataset's row ``i``, and rows it left out are never read.

    >>> import evenly
    >>> ds = evenly.Dataset(from_arrow("data/train"), shuffle=True)  # doctest: +SKIP
    >>> import datasets
    >>> hf = datasets.load_from_disk("data/train").shuffle(seed=0)  # doctest: +SKIP
    >>> src = from_arrow(hf)  # doctest: +SKIP
    """
    options: dict[str, Any] = {
        "storage_options": storage_options,
        "cache_dir": cache_dir,
        "cache_bytes": cache_bytes,
        "max_in_flight": max_in_flight,
        "use_manifest": use_manifest,
    }
    if hasattr(paths, "cache_files") and hasattr(paths, "_data"):
        files, mapping, ident, chosen = _hf_dataset(
            paths, None if columns is None else list(columns)
        )
        source = ArrowSource(files, columns=chosen, mapping=mapping, mapping_id=ident, **options)
        _check_hf_table(source, paths)
        return source
    if isinstance(paths, str | os.PathLike) and os.path.isdir(paths):
        path = os.fspath(paths)
        if os.path.exists(os.path.join(path, "state.json")) or os.path.exists(
            os.path.join(path, "dataset_dict.json")
        ):
            files, mapping, ident = _hf_directory(path)
            return ArrowSource(files, columns=columns, mapping=mapping, mapping_id=ident, **options)
    return ArrowSource(paths, columns=columns, **options)
