"""``evenly.write``: pack any iterable or map-style dataset into shards plus a manifest.

The shards are plain Parquet, WebDataset tar or JSON Lines files, readable by pyarrow,
HF ``datasets`` or ``webdataset`` without evenly; the manifest
(``.evenly-manifest.json``, a hidden file those tools ignore) lets ``from_*`` open the
directory without scanning a shard.

>>> import tempfile, evenly.sources as es
>>> out = tempfile.mkdtemp()
>>> paths = es.write(({"id": i} for i in range(10)), out, rows_per_shard=4, progress=False)
>>> [p.rsplit("/", 1)[-1] for p in paths]
['shard-00000.parquet', 'shard-00001.parquet', 'shard-00002.parquet']
>>> len(es.from_parquet(out))
10
"""

from __future__ import annotations

import io
import json
import os
import tarfile
import tempfile
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from tqdm.auto import tqdm

from ._jsonl import JsonlSource
from ._manifest import save_manifest
from ._parquet import ParquetSource
from ._webdataset import WebDatasetSource, check_member_name

__all__ = ["FORMATS", "write"]

FORMATS = {"parquet": ".parquet", "webdataset": ".tar", "jsonl": ".jsonl"}


def _samples(data: Any) -> tuple[Iterator[Any], int | None]:
    """Iterate ``data``: by index if it is map-style (``__len__`` + ``__getitem__``)."""
    if hasattr(data, "__len__") and hasattr(data, "__getitem__") and not isinstance(data, dict):
        n = len(data)
        return (data[i] for i in range(n)), n
    total = len(data) if hasattr(data, "__len__") else None
    return iter(data), total


def _plain(value: Any) -> Any:
    """Tensors and numpy values -> Python / numpy values pyarrow and json understand."""
    if hasattr(value, "detach") and hasattr(value, "numpy"):
        value = value.detach().cpu().numpy()
    if isinstance(value, np.generic):
        return value.item()
    return value


def _row(sample: Any, index: int) -> dict[str, Any]:
    if isinstance(sample, dict):
        return {str(k): _plain(v) for k, v in sample.items()}
    if isinstance(sample, tuple | list):
        return {str(i): _plain(v) for i, v in enumerate(sample)}
    return {"value": _plain(sample)}


def _jsonable(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, bytes | bytearray):
        raise TypeError(
            "bytes cannot be written to JSON Lines; use format='parquet' or 'webdataset'"
        )
    return value


def _field_bytes(value: Any) -> bytes:
    if isinstance(value, bytes | bytearray):
        return bytes(value)
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, np.ndarray):
        buf = io.BytesIO()
        np.save(buf, value, allow_pickle=False)
        return buf.getvalue()
    return json.dumps(value).encode("utf-8")


class _Shard:
    """One shard being written to a temp file, renamed into place on ``close``."""

    def __init__(self, path: str, fmt: str, row_group_size: int) -> None:
        self.path = path
        self.fmt = fmt
        self.row_group_size = row_group_size
        fd, self.tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
        os.close(fd)
        self.rows: list[dict[str, Any]] = []

    def add(self, row: dict[str, Any]) -> None:
        self.rows.append(row)

    def close(self, schema: pa.Schema | None, first_index: int) -> pa.Schema | None:
        try:
            schema = getattr(self, f"_write_{self.fmt}")(schema, first_index)
            os.replace(self.tmp, self.path)
        finally:
            if os.path.exists(self.tmp):
                os.unlink(self.tmp)
        return schema

    def _write_parquet(self, schema: pa.Schema | None, first_index: int) -> pa.Schema:
        try:
            table = pa.Table.from_pylist(self.rows, schema=schema)
        except (pa.ArrowInvalid, pa.ArrowTypeError, KeyError) as exc:
            raise ValueError(
                f"evenly.write: samples {first_index}..{first_index + len(self.rows) - 1} do "
                f"not fit the schema of the first shard ({exc}); every sample needs the same "
                f"fields and types"
            ) from exc
        pq.write_table(table, self.tmp, row_group_size=self.row_group_size)
        return table.schema

    def _write_jsonl(self, schema: pa.Schema | None, first_index: int) -> None:
        with open(self.tmp, "w", encoding="utf-8") as f:
            for i, row in enumerate(self.rows):
                try:
                    f.write(json.dumps(row, default=_jsonable, ensure_ascii=False) + "\n")
                except TypeError as exc:
                    raise TypeError(f"evenly.write: sample {first_index + i}: {exc}") from None

    def _write_webdataset(self, schema: pa.Schema | None, first_index: int) -> None:
        with tarfile.open(self.tmp, "w", format=tarfile.USTAR_FORMAT) as tar:
            for i, row in enumerate(self.rows):
                key = str(row.pop("__key__", f"{first_index + i:012d}"))
                check_member_name(key)
                if "." in key.rsplit("/", 1)[-1]:
                    raise ValueError(
                        f"evenly.write: sample {first_index + i}: key {key!r} has a '.'"
                    )
                for ext, value in row.items():
                    data = _field_bytes(value)
                    info = tarfile.TarInfo(f"{key}.{ext}")
                    info.size = len(data)
                    info.mode = 0o644
                    tar.addfile(info, io.BytesIO(data))


def write(
    samples: Iterable[Any] | Any,
    out_dir: str | os.PathLike[str],
    format: str = "parquet",
    rows_per_shard: int = 10_000,
    *,
    row_group_size: int | None = None,
    prefix: str = "shard",
    progress: bool = True,
) -> list[str]:
    """Write ``samples`` (an iterable, or a map-style dataset) as shards in ``out_dir``.

    A sample is a dict of fields (a tuple becomes fields ``"0"``, ``"1"``...; anything
    else a field ``"value"``).  Returns the shard paths.  For ``"webdataset"``, bytes
    and str are stored as is, numpy arrays as ``.npy``, anything else as JSON; the key
    is ``sample["__key__"]`` if present.

    Args:
        format: ``"parquet"``, ``"webdataset"`` or ``"jsonl"``.
        rows_per_shard: samples per shard (the last shard may hold fewer).
        row_group_size: Parquet rows per row group (default ``min(rows_per_shard, 1024)``),
            the unit of a random read.
        prefix: shard file names are ``{prefix}-{n:05d}{ext}``.
        progress: show a tqdm progress bar.
    """
    if format not in FORMATS:
        raise ValueError(f"evenly.write: format must be one of {sorted(FORMATS)}, got {format!r}")
    if (
        isinstance(rows_per_shard, bool)
        or not isinstance(rows_per_shard, int)
        or rows_per_shard < 1
    ):
        raise ValueError(
            f"evenly.write: rows_per_shard must be an integer >= 1, got {rows_per_shard!r}"
        )
    groups = row_group_size or min(rows_per_shard, 1024)
    out = os.path.abspath(os.fspath(out_dir))
    os.makedirs(out, exist_ok=True)
    it, total = _samples(samples)
    paths: list[str] = []
    counts: list[int] = []
    schema: pa.Schema | None = None
    shard: _Shard | None = None
    written = 0
    bar = tqdm(total=total, unit="sample", desc=f"evenly.write {format}", disable=not progress)
    try:
        for index, sample in enumerate(it):
            if shard is None:
                path = os.path.join(out, f"{prefix}-{len(paths):05d}{FORMATS[format]}")
                shard = _Shard(path, format, groups)
            shard.add(_row(sample, index))
            if len(shard.rows) == rows_per_shard:
                schema = shard.close(schema, written)
                paths.append(shard.path)
                counts.append(len(shard.rows))
                written += len(shard.rows)
                shard = None
            bar.update(1)
        if shard is not None:
            schema = shard.close(schema, written)
            paths.append(shard.path)
            counts.append(len(shard.rows))
    finally:
        bar.close()
    _write_manifest(out, format, paths)
    return paths


def _write_manifest(out: str, format: str, paths: list[str]) -> None:
    """Scan the new shards once (cheap: local, just written) and save the manifest."""
    if not paths:
        return
    cls = {"parquet": ParquetSource, "webdataset": WebDatasetSource, "jsonl": JsonlSource}[format]
    source = cls(paths, use_manifest=False, keep_entries=True)
    save_manifest(out, format, source.entries or [])
