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

from ._base import Paths, RowError, ShardedSource
from ._manifest import FileEntry, pack_array, unpack_array

__all__ = ["JsonlSource", "from_jsonl", "index_lines"]

_CHUNK = 4 << 20


class JsonlSource(ShardedSource):
    """JSON Lines shards as one indexable source; a sample is the line's parsed value.

    Blank lines (empty, or only spaces, tabs and ``\\r``) are not samples.  A read
    checks that a newline still precedes and ends the line (else the file changed since
    its manifest was written: an error, never another row's bytes).  Build it with
    :func:`from_jsonl`.
    """

    format = "jsonl"
    extensions = (".jsonl", ".ndjson")

    def _scan(self, k: int, url: str) -> tuple[int, dict[str, Any]]:
        with self.open_local(k) as f:
            starts, ends = index_lines(f)
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
        read = 0
        for pos in np.argsort(rows, kind="stable").tolist():
            row = int(rows[pos])
            lo, hi = int(starts[row]), int(ends[row])
            # with the newline before and after: a cheap check that the line is still there
            head = 1 if lo else 0
            data = os.pread(fd, hi - lo + head + 1, lo - head)
            read += len(data)
            if len(data) < hi - lo + head:
                raise RowError(
                    row,
                    f"the file is truncated: line {self._line_number(handle, lo)} ends at "
                    f"byte {lo - head + len(data)}, expected {hi}",
                )
            if (head and data[0] != 10) or (len(data) > hi - lo + head and data[-1] != 10):
                raise RowError(
                    row,
                    f"the file changed since its manifest was written: row {row} should be "
                    f"the line at bytes {lo}..{hi}, but no line starts or ends there; open "
                    f"the dataset again (a changed file is scanned again)",
                )
            body = data[head : head + hi - lo]
            try:
                out[pos] = json.loads(body)
            except ValueError as exc:
                line = self._line_number(handle, lo)
                raise RowError(
                    row, f"line {line} is not valid JSON ({exc}): {body[:80]!r}"
                ) from None
        self._count(bytes_read=read)
        return out

    @staticmethod
    def _line_number(handle: Any, offset: int) -> int:
        """1-based line number of the byte at ``offset`` (errors only: reads the prefix)."""
        handle.seek(0)
        return int(handle.read(offset).count(b"\n")) + 1


def index_lines(f: Any) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """``(starts, ends)`` byte offsets of the lines of a binary file that hold more than
    JSON whitespace (space, tab, CR, LF): blank, CRLF-only and space-only lines are not
    samples.  ``ends`` is each line's newline (or the file size).  Vectorised per chunk.
    """
    newlines: list[npt.NDArray[np.int64]] = []
    filled: list[npt.NDArray[np.bool_]] = []
    size = 0
    pending = 0  # non-whitespace bytes of the line not ended yet
    while chunk := f.read(_CHUNK):
        if size == 0:
            _check_text(chunk)
        buf = np.frombuffer(chunk, dtype=np.uint8)
        nl = np.flatnonzero(buf == 10)
        text = (buf != 32) & (buf != 9) & (buf != 13) & (buf != 10)
        seen = np.cumsum(text, dtype=np.int32)  # non-whitespace bytes up to each byte
        at = seen[nl]
        per_line = np.diff(at, prepend=np.int32(0))
        if nl.size:
            per_line[0] += pending
            pending = int(seen[-1] - at[-1])
        else:
            pending += int(seen[-1])
        newlines.append(nl.astype(np.int64) + size)
        filled.append(per_line > 0)
        size += len(chunk)
    ends = np.concatenate([*newlines, np.zeros(0, np.int64)])
    keep = np.concatenate([*filled, np.zeros(0, np.bool_)])
    if size and (ends.size == 0 or int(ends[-1]) != size - 1):  # a last line without \n
        ends = np.append(ends, size)
        keep = np.append(keep, pending > 0)
    starts = np.concatenate([[0], ends[:-1] + 1]).astype(np.int64)[: ends.size]
    return starts[keep], ends[keep]


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
    max_in_flight: int | None = None,
    use_manifest: bool = True,
) -> JsonlSource:
    """A source over JSON Lines shards: a list, a glob, a directory or an fsspec URL.

    A one-time scan records each line's byte offsets (cached in the manifest), so any
    sample is one seek and one read.  Remote shards are downloaded into a bounded local
    cache (``cache_dir``, ``cache_bytes``), at most ``max_in_flight`` requests in flight
    per node (default ``$EVENLY_MAX_IN_FLIGHT``, else 16).

    >>> import evenly
    >>> ds = evenly.Dataset(from_jsonl("s3://bucket/text/"), shuffle=True)  # doctest: +SKIP
    """
    return JsonlSource(
        paths,
        storage_options=storage_options,
        cache_dir=cache_dir,
        cache_bytes=cache_bytes,
        max_in_flight=max_in_flight,
        use_manifest=use_manifest,
    )
