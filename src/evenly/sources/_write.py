"""``evenly.write``: pack any iterable or map-style dataset into shards plus a manifest.

The shards are plain Parquet, Arrow IPC, WebDataset tar or JSON Lines files, readable by
pyarrow, HF ``datasets`` or ``webdataset`` without evenly; the manifest
(``.evenly-manifest.json``, a hidden file those tools ignore) lets ``from_*`` open the
directory without scanning a shard.

>>> import tempfile, evenly.sources as es
>>> out = tempfile.mkdtemp()
>>> paths = es.write(({"id": i} for i in range(10)), out, rows_per_shard=4, progress=False)
>>> [p.rsplit("/", 1)[-1] for p in paths]
['shard-00000.parquet', 'shard-00001.parquet', 'shard-00002.parquet']
>>> len(es.from_parquet(out))
10

Rows with different fields are written with the union of the fields (absent = null);
a value that does not fit its field's type raises, naming the sample:

>>> rows = [{"a": 3}, {"a": 4, "b": "extra"}]
>>> _ = es.write(rows, tempfile.mkdtemp(), format="arrow", progress=False)
"""

from __future__ import annotations

import io
import json
import os
import tarfile
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from evenly.errors import check_int
from evenly.options import Format

from ._arrow import ArrowSource
from ._jsonl import JsonlSource
from ._manifest import save_manifest
from ._parquet import ParquetSource
from ._progress import bar as progress_bar
from ._tokenize import tokenized_rows
from ._webdataset import WebDatasetSource, check_member_name

__all__ = ["FORMATS", "write"]

FORMATS: dict[Format, str] = {
    "parquet": ".parquet",
    "arrow": ".arrow",
    "webdataset": ".tar",
    "jsonl": ".jsonl",
}
_ERRORS = (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError, OverflowError)


def _samples(data: Any) -> tuple[Iterator[Any], int | None]:
    """Iterate ``data``: by index if it is map-style (``__len__`` + ``__getitem__``)."""
    if hasattr(data, "__len__") and hasattr(data, "__getitem__") and not isinstance(data, dict):
        n = len(data)
        if hasattr(data, "__getitems__"):  # an evenly source: read 1024 samples a call
            chunks = (
                data.__getitems__(list(range(i, min(i + 1024, n)))) for i in range(0, n, 1024)
            )
            return (s for chunk in chunks for s in chunk), n
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


def _first_misfit(values: list[Any], t: pa.DataType | None) -> tuple[int, pa.DataType]:
    """The first value (and the type it misses) that cannot be converted with the others."""
    if t is None:
        t = next(pa.array([v]).type for v in values if v is not None)
    for j, v in enumerate(values):
        try:
            pa.array([v], type=t)
        except _ERRORS:
            return j, t
    return 0, t


def _dropped_key(value: Any, t: pa.DataType, path: str) -> str | None:
    """A dict key that the conversion to struct type ``t`` would silently drop."""
    if isinstance(value, dict) and pa.types.is_struct(t):
        names = {t.field(i).name: t.field(i).type for i in range(t.num_fields)}
        for key, v in value.items():
            if key not in names:
                return f"{path}.{key}"
            found = _dropped_key(v, names[key], f"{path}.{key}")
            if found:
                return found
    elif isinstance(value, list | tuple) and (
        pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)
    ):
        for v in value:
            found = _dropped_key(v, t.value_type, f"{path}[]")
            if found:
                return found
    return None


def _has_struct(t: pa.DataType) -> bool:
    if pa.types.is_struct(t):
        return True
    return bool(
        (pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t))
        and _has_struct(t.value_type)
    )


def _table(
    rows: list[dict[str, Any]], schema: pa.Schema | None, first: int, origin: str
) -> pa.Table:
    """Rows -> an Arrow table with every field any row has (absent = null), typed by
    ``schema`` if given, else inferred from all the rows.  A value that does not fit, or a
    field ``schema`` lacks, raises naming the sample: no field is ever dropped."""
    names = list(dict.fromkeys(k for row in rows for k in row))
    if schema is not None:
        extra = [n for n in names if n not in schema.names]
        if extra:
            j = next(j for j, row in enumerate(rows) if extra[0] in row)
            raise ValueError(
                f"evenly.write: sample {first + j} has a field {extra[0]!r} that {origin} "
                f"lacks (its fields: {schema.names}); pass schema= with every field (a "
                f"field a sample lacks is written as null)"
            )
        names = list(schema.names)
    arrays = []
    for name in names:
        t = None if schema is None else schema.field(name).type
        values = [row.get(name) for row in rows]
        try:
            array = pa.array(values, type=t)
        except _ERRORS as exc:
            j, want = _first_misfit(values, t)
            hint = (
                f"the field was null in every sample of {origin}, so its type is unknown"
                if pa.types.is_null(want)
                else "every sample needs one type per field"
            )
            raise ValueError(
                f"evenly.write: sample {first + j}: field {name!r} holds "
                f"{type(values[j]).__name__} {str(values[j])[:60]!r}, which does not fit "
                f"{want} ({exc}); {hint}: convert it, or pass schema=pyarrow.schema([...])"
            ) from None
        if _has_struct(array.type):
            for j, v in enumerate(values):
                key = _dropped_key(v, array.type, name)
                if key:
                    raise ValueError(
                        f"evenly.write: sample {first + j}: key {key!r} is not in the type "
                        f"{array.type} of field {name!r} (fixed by {origin}); pass "
                        f"schema= with every key"
                    )
        arrays.append(array)
    if schema is None:
        return pa.Table.from_arrays(arrays, names=names)
    return pa.Table.from_arrays(arrays, schema=schema)


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

    def close(
        self, schema: pa.Schema | None, first_index: int, origin: str = ""
    ) -> pa.Schema | None:
        try:
            if self.fmt in ("parquet", "arrow"):
                table = _table(self.rows, schema, first_index, origin)
                getattr(self, f"_write_{self.fmt}")(table)
                schema = table.schema
            else:
                getattr(self, f"_write_{self.fmt}")(schema, first_index)
            os.replace(self.tmp, self.path)
        finally:
            if os.path.exists(self.tmp):
                os.unlink(self.tmp)
        return schema

    def _write_parquet(self, table: pa.Table) -> None:
        # page checksums: ``from_parquet`` verifies them, so a flipped bit is an error
        pq.write_table(
            table, self.tmp, row_group_size=self.row_group_size, write_page_checksum=True
        )

    def _write_arrow(self, table: pa.Table) -> None:
        with pa.OSFile(self.tmp, "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
            w.write_table(table, max_chunksize=self.row_group_size)

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
    format: Format = "parquet",
    rows_per_shard: int = 10_000,
    *,
    row_group_size: int | None = None,
    schema: pa.Schema | None = None,
    prefix: str = "shard",
    progress: bool | None = None,
    tokenize: Callable[[list[str]], list[list[int]]] | None = None,
    text_field: str = "text",
    keep_fields: Sequence[str] = (),
    tokenize_batch: int = 1000,
) -> list[str]:
    """Write ``samples`` (an iterable, or a map-style dataset) as shards in ``out_dir``.

    A sample is a dict of fields (a tuple becomes fields ``"0"``, ``"1"``...; anything
    else a field ``"value"``).  Returns the shard paths.  For ``"parquet"`` and
    ``"arrow"`` every field of every sample is written: the first shard's fields are the
    union over its samples (a field a sample lacks is null), types are inferred from all
    of them, and later shards must fit that schema (or ``schema``); a value that does not
    fit raises, naming the sample and the field.  For ``"webdataset"``, bytes
    and str are stored as is, numpy arrays as ``.npy``, anything else as JSON; the key
    is ``sample["__key__"]`` if present.

    Args:
        format: ``"parquet"``, ``"arrow"`` (Arrow IPC files, memory-mapped by
            :func:`from_arrow`), ``"webdataset"`` or ``"jsonl"``.
        rows_per_shard: samples per shard (the last shard may hold fewer).
        row_group_size: Parquet rows per row group, Arrow rows per record batch (default
            ``min(rows_per_shard, 1024)``), the unit of a random read.
        schema: the ``pyarrow.Schema`` of every shard (Parquet and Arrow), e.g. for a
            field that is null in the first shard, or
            ``pa.list_(pa.uint8(), 1024)`` for a fixed-size array that
            ``read_columns`` stacks as ``[B, 1024]``.
        prefix: shard file names are ``{prefix}-{n:05d}{ext}``.
        progress: show a tqdm progress bar: ``None`` (default) on a terminal only
            (``EVENLY_PROGRESS=1``/``0`` forces it on/off), ``True``/``False`` always/never.
        tokenize: tokenize-and-shard mode: samples are texts (``text_field`` of a dict,
            or the string itself), tokenized ``tokenize_batch`` at a time by
            ``tokenize(texts) -> token ids`` (e.g. :func:`evenly.tokenizer`), and each
            row is ``{"input_ids": list<int32>}`` plus the fields in ``keep_fields``;
            ``"parquet"`` or ``"arrow"`` only.  The shards are the fast path for
            ``evenly.Packing`` (lengths read from the column, no tokenizer pass).
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
    if schema is not None and format not in ("parquet", "arrow"):
        raise ValueError(f"evenly.write: schema= applies to 'parquet' and 'arrow', not {format!r}")
    if tokenize is not None:
        if format not in ("parquet", "arrow"):
            raise ValueError(
                f"evenly.write(tokenize=...) writes 'parquet' or 'arrow' shards, not {format!r}"
            )
        it, n = _samples(samples)
        samples = tokenized_rows(
            it,
            n,
            tokenize,
            text_field=text_field,
            keep_fields=keep_fields,
            batch_size=check_int("tokenize_batch", tokenize_batch, minimum=1),
        )
        if schema is None and not keep_fields:
            schema = pa.schema([("input_ids", pa.list_(pa.int32()))])
    groups = row_group_size or min(rows_per_shard, 1024)
    out = os.path.abspath(os.fspath(out_dir))
    os.makedirs(out, exist_ok=True)
    it, total = _samples(samples)
    paths: list[str] = []
    counts: list[int] = []
    origin = "schema=" if schema is not None else "the first shard"
    fixed = schema is not None
    shard: _Shard | None = None
    written = 0
    bar = progress_bar(total, f"evenly.write {format}", unit="sample", show=progress)
    try:
        for index, sample in enumerate(it):
            if shard is None:
                path = os.path.join(out, f"{prefix}-{len(paths):05d}{FORMATS[format]}")
                shard = _Shard(path, format, groups)
            shard.add(_row(sample, index))
            if len(shard.rows) == rows_per_shard:
                schema = shard.close(schema, written, origin)
                if not fixed:
                    origin, fixed = f"shard 0 (samples 0..{len(shard.rows) - 1})", True
                paths.append(shard.path)
                counts.append(len(shard.rows))
                written += len(shard.rows)
                shard = None
            bar.update(1)
        if shard is not None:
            schema = shard.close(schema, written, origin)
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
    cls = {
        "parquet": ParquetSource,
        "arrow": ArrowSource,
        "webdataset": WebDatasetSource,
        "jsonl": JsonlSource,
    }[format]
    source = cls(paths, use_manifest=False, keep_entries=True)
    save_manifest(out, format, source.entries or [])
