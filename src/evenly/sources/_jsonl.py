"""``evenly.from_jsonl``: JSON Lines shards (one JSON object per line) with a line index.

>>> import os, tempfile
>>> d = tempfile.mkdtemp()
>>> with open(os.path.join(d, "a.jsonl"), "w") as f:
...     _ = f.write('{"id": 0}\\n{"id": 1}\\n\\n{"id": 2}\\n')
>>> src = from_jsonl(d, cache_dir=os.path.join(d, ".cache"))
>>> len(src), src[2]
(3, {'id': 2})
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import numpy.typing as npt
from fsspec.core import url_to_fs

from ._base import Paths, ShardedSource
from ._manifest import FileEntry, pack_array, unpack_array

__all__ = ["JsonlSource", "from_jsonl"]

_CHUNK = 8 << 20


class JsonlSource(ShardedSource):
    """JSON Lines shards as one indexable source; a sample is the line's parsed value.

    Empty lines are not samples.  Build it with :func:`from_jsonl`.
    """

    format = "jsonl"
    extensions = (".jsonl", ".ndjson")

    def _scan(self, k: int, url: str) -> tuple[int, dict[str, Any]]:
        path = self.local_path(k)
        fs, p = url_to_fs(path)
        newlines: list[npt.NDArray[np.int64]] = []
        size = 0
        with fs.open(p, "rb") as f:
            while chunk := f.read(_CHUNK):
                if size == 0:
                    _check_text(chunk)
                buf = np.frombuffer(chunk, dtype=np.uint8)
                newlines.append(np.flatnonzero(buf == 10).astype(np.int64) + size)
                size += len(chunk)
        ends = np.concatenate([*newlines, np.zeros(0, np.int64)])
        if size and (ends.size == 0 or int(ends[-1]) != size - 1):
            ends = np.append(ends, size)  # a last line without a newline
        starts = np.concatenate([[0], ends[:-1] + 1]).astype(np.int64) if ends.size else ends
        keep = ends > starts
        starts, ends = starts[keep], ends[keep]
        return int(starts.size), {"starts": pack_array(starts), "ends": pack_array(ends)}

    def _setup(self, entries: list[FileEntry]) -> None:
        self._lines = [
            (unpack_array(e.meta["starts"]), unpack_array(e.meta["ends"])) for e in entries
        ]

    def _open(self, k: int, path: str) -> Any:
        return open(path, "rb")

    def _read(self, k: int, handle: Any, rows: npt.NDArray[np.int64]) -> list[Any]:
        starts, ends = self._lines[k]
        fd = handle.fileno()
        out: list[Any] = [None] * rows.size
        for pos in np.argsort(rows, kind="stable").tolist():
            row = int(rows[pos])
            lo, hi = int(starts[row]), int(ends[row])
            data = os.pread(fd, hi - lo, lo)
            if len(data) != hi - lo:
                raise ValueError(
                    f"the file is truncated: line {self._line_number(handle, lo)} ends at byte "
                    f"{lo + len(data)}, expected {hi}"
                )
            try:
                out[pos] = json.loads(data)
            except ValueError as exc:
                line = self._line_number(handle, lo)
                raise ValueError(f"line {line} is not valid JSON ({exc}): {data[:80]!r}") from None
        return out

    @staticmethod
    def _line_number(handle: Any, offset: int) -> int:
        """1-based line number of the byte at ``offset`` (errors only: reads the prefix)."""
        handle.seek(0)
        return int(handle.read(offset).count(b"\n")) + 1


def _check_text(head: bytes) -> None:
    if head[:2] == b"\x1f\x8b":
        raise ValueError("it is gzip-compressed, not JSON Lines text; decompress it first")
    if b"\x00" in head[:4096]:
        raise ValueError("it is a binary file, not JSON Lines text; is the extension wrong?")
    try:
        head[:4096].decode("utf-8")
    except UnicodeDecodeError as exc:
        if exc.start < min(len(head), 4096) - 4:  # not just a character cut by the slice
            raise ValueError(f"it is not UTF-8 text ({exc}); is the extension wrong?") from None


def from_jsonl(
    paths: Paths,
    *,
    storage_options: dict[str, Any] | None = None,
    cache_dir: str | None = None,
    cache_bytes: int | None = None,
    use_manifest: bool = True,
) -> JsonlSource:
    """A source over JSON Lines shards: a list, a glob, a directory or an fsspec URL.

    A one-time scan records each line's byte offsets (cached in the manifest), so any
    sample is one seek and one read.

    >>> import evenly
    >>> ds = evenly.Dataset(from_jsonl("s3://bucket/text/"), shuffle=True)  # doctest: +SKIP
    """
    return JsonlSource(
        paths,
        storage_options=storage_options,
        cache_dir=cache_dir,
        cache_bytes=cache_bytes,
        use_manifest=use_manifest,
    )
