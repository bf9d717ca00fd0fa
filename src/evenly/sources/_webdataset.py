"""``evenly.from_webdataset``: random access over existing WebDataset tar shards.

Files are grouped into samples as WebDataset does: a member ``dir/abc.seg.png`` has key
``dir/abc`` and field ``seg.png``, and consecutive members with one key form a sample.
A one-time scan of the member headers (cached in the manifest) records where each
field's bytes lie, so a sample is a few seeks and reads.

>>> import io, os, tarfile, tempfile
>>> d = tempfile.mkdtemp()
>>> with tarfile.open(os.path.join(d, "a.tar"), "w") as tar:
...     for key in ("x", "y"):
...         for ext, data in (("txt", key.encode()), ("cls", b"1")):
...             info = tarfile.TarInfo(f"{key}.{ext}"); info.size = len(data)
...             tar.addfile(info, io.BytesIO(data))
>>> src = from_webdataset(d, cache_dir=os.path.join(d, ".cache"))
>>> len(src), src[1]["__key__"], src[1]["txt"]
(2, 'y', b'y')
"""

from __future__ import annotations

import os
import re
import tarfile
from collections.abc import Sequence
from dataclasses import dataclass
from posixpath import isabs
from typing import Any

import numpy as np
import numpy.typing as npt

from ._base import Paths, ShardedSource
from ._manifest import FileEntry, pack_array, unpack_array
from ._ranges import RangeReader, per_process
from ._tarread import read_batch, sample_spans, split_name

__all__ = ["FIRST_BY_RANGE", "WebDatasetSource", "from_webdataset", "split_name"]

#: a pass's first batch read through the shard cache reads its samples by range where
#: their bytes are at most this part of the bytes of their shards not cached yet
FIRST_BY_RANGE = 1 / 8


def check_member_name(name: str) -> None:
    """Reject absolute member names and names with a ``..`` part."""
    if isabs(name) or name.startswith("\\") or ".." in re.split(r"[/\\]", name):
        raise ValueError(
            f"unsafe member name {name!r} (absolute or with '..'); evenly refuses such "
            f"tar files: rewrite them with relative names"
        )


class WebDatasetSource(ShardedSource):
    """WebDataset tar shards as one source; a sample is ``{"__key__", "__url__", field: bytes}``.

    A read checks each member's tar header (just before its data) against the manifest:
    a file changed since then raises an error naming the sample, never serves another
    sample's bytes.  Build it with :func:`from_webdataset`.

    Remote shards read in a global shuffle are read by byte range (see
    :mod:`evenly.sources._ranges`): each sample's members, the next batches' ahead,
    nothing downloaded whole; a shard already in the local cache is read from there.
    Otherwise a process's first batch of a pass reads its samples of shards not yet in
    the cache by range too, where they are a small part of those shards
    (:data:`FIRST_BY_RANGE`; a block shuffle's first batch has a few samples of every
    shard of its window): its own members, not their whole shards, which download after
    it; every later batch reads through the shard cache.
    """

    format = "webdataset"
    extensions = (".tar",)

    def __init__(self, paths: Paths, *, check_fields: bool = True, **kwargs: Any) -> None:
        self.check_fields = check_fields
        #: requests in flight in this process while a global shuffle reads by range
        #: (None: the pass reads through the shard cache)
        self._range_limit: int | None = None
        self._ranges: RangeReader | None = None
        #: shard -> read from its local cached copy (True) or by range (False), this pass
        self._local: dict[int, bool] = {}
        #: requests in flight for this process's first batch of a pass read through the
        #: shard cache, read by range (None: that batch is read, or no pass is)
        self._first_limit: int | None = None
        super().__init__(paths, **kwargs)

    def _scan(self, k: int, url: str) -> tuple[int, dict[str, Any]]:
        with self.open_local(k) as f:
            return _scan_tar(f)

    def _setup(self, entries: list[FileEntry]) -> None:
        tables = [_Members.from_meta(e.meta) for e in entries]
        if self.check_fields:
            fields = [sorted(t.names) for t in tables]
            ref = next((k for k, f in enumerate(fields) if f), None)
            for k, f in enumerate(fields):
                if f and ref is not None and f != fields[ref]:
                    raise ValueError(
                        f"{self._what}: the fields of shard {k} ({entries[k].url}) differ "
                        f"from shard {ref} ({entries[ref].url}): {f} vs {fields[ref]}; pass "
                        f"check_fields=False if samples legitimately vary"
                    )
        self._members = _Members.join(tables)

    def _open(self, k: int, path: str) -> Any:
        return open(path, "rb")

    def prepare_pass(self, shuffle: str, readers: int) -> None:
        """Called where a pass is read, before its first batch: under the global shuffle,
        remote shards are read by range (the node's ``max_in_flight`` requests shared
        by its ranks and each rank's ``readers``), else through the shard cache."""
        self._local = {}
        limit = per_process(getattr(self.cache, "max_in_flight", None), readers)
        self._first_limit = None
        if shuffle != "global" or self.cache is None:
            self._close_ranges()
            self._range_limit = None
            if self.cache is not None:
                self._first_limit = limit
            return
        if limit != self._range_limit:
            self._close_ranges()
        elif self._ranges is not None and self._ranges.pid == os.getpid():
            self._ranges.restart()
        self._range_limit = limit

    def _reader(self) -> RangeReader | None:
        """This process's range reader while a pass reads by range."""
        if self._range_limit is None or self.cache is None:
            return None
        reader = self._ranges
        if reader is not None and reader.pid != os.getpid():  # forked: its own
            reader = self._ranges = None
        if reader is None:
            cache = self.cache
            reader = self._ranges = RangeReader(
                self.urls,
                self._fingerprints,
                self._shards.storage_options,
                lambda idx: sample_spans(self, idx),
                cache.retrying,
                self._range_limit,
                cache.obstore,
            )
        return reader

    def _is_remote(self, k: int) -> bool:
        """Whether shard ``k`` is read by range in this pass: decided at its first read
        (a shard in the local cache is read from there, its file kept open)."""
        local = self._local.get(k)
        if local is None:
            cache = self.cache
            local = cache is None or os.path.exists(
                cache.path_for(self.urls[k], self._fingerprints[k])
            )
            if local:
                self._handle(k)
            self._local[k] = local
        return not local

    def prefetch(self, indices: Sequence[int]) -> None:
        """The plan's next samples: reading by range, they are read ahead of their batch;
        else their shards are downloaded (remote only), in first-use order."""
        reader = self._reader()
        if reader is None:
            super().prefetch(indices)
        else:
            reader.hint(np.asarray(indices, dtype=np.int64))

    def io_stats(self) -> dict[str, float]:
        """As for every source, plus ``bytes_fetched``, ``fetch_requests`` and
        ``fetch_seconds`` of the reads by range."""
        out = super().io_stats()
        if self._ranges is not None and self._ranges.pid == os.getpid():
            for name, value in self._ranges.counters().items():
                out[name] = out.get(name, 0) + value
        return out

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """Read a batch: every member of every sample located in one go, read with
        sorted, coalesced ``pread``s per shard in use (or by range, see
        :meth:`prepare_pass`), every member's tar header checked against the manifest
        (see :mod:`evenly.sources._tarread`); samples in the order asked."""
        idx = self._check_indices(indices)
        reader = self._reader()
        if reader is None:
            fetched = self._first_by_range(idx)
            if fetched is not None:
                return read_batch(self, idx, fetched)
            self.prefetch(idx.tolist())
            return read_batch(self, idx)
        return read_batch(self, idx, reader.read(idx, self._is_remote))

    def _first_by_range(self, idx: npt.NDArray[np.int64]) -> dict[tuple[int, int], bytes] | None:
        """The first batch of a pass read through the shard cache: the spans of its samples
        in shards not in the cache yet, read by range (each request carries the listed
        ETag), so that it waits for its own members, not for their whole shards (a block
        shuffle's first batch has samples of every shard of its window).  None: not the
        first batch, all its shards are here (read from their copies), or its samples
        are more than :data:`FIRST_BY_RANGE` of the shards' bytes (read whole)."""
        limit, self._first_limit = self._first_limit, None
        cache = self.cache
        if limit is None or cache is None:
            return None
        shards = np.unique(self.shard_of(idx)).tolist()
        away = [
            k
            for k in shards
            if not os.path.exists(cache.path_for(self.urls[k], self._fingerprints[k]))
        ]
        ks, lo, hi = sample_spans(self, idx)
        spans = int((hi - lo)[np.isin(ks, away)].sum())
        whole = sum(self._shards.sizes[k] for k in away) if self._shards.sizes else 0
        if not spans or spans > whole * FIRST_BY_RANGE:
            return None  # the shards whole cost about as much, and nothing is read twice
        reader = RangeReader(
            self.urls,
            self._fingerprints,
            self._shards.storage_options,
            lambda i: sample_spans(self, i),
            cache.retrying,
            limit,
            cache.obstore,
        )
        try:
            return reader.read(idx, set(away).__contains__)
        finally:
            self._count(**reader.counters())
            reader.close()

    def _close_ranges(self) -> None:
        reader, self._ranges = self._ranges, None
        if reader is not None and reader.pid == os.getpid():
            self._count(**reader.counters())  # the counters stay cumulative
            reader.close()

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.update(_ranges=None, _local={}, _first_limit=None)
        return state

    def close(self) -> None:
        """Close the files this process holds open, and stop reading by range."""
        self._close_ranges()
        super().close()


def _scan_tar(f: Any) -> tuple[int, dict[str, Any]]:
    """Index the members of an open tar file (one pass over the headers)."""
    head = f.read(512)
    size = f.seek(0, 2)
    f.seek(0)
    if head[:2] == b"\x1f\x8b" or head[:3] == b"BZh" or head[:6] == b"\xfd7zXZ\x00":
        raise ValueError(
            "it is a compressed tar; evenly reads uncompressed tar shards (random "
            "access needs offsets): decompress it, e.g. gunzip"
        )
    samples: list[list[Any]] = []
    try:
        with tarfile.open(fileobj=f, mode="r:") as tar:
            for member in tar:
                check_member_name(member.name)
                if not member.isfile():
                    continue
                if member.issparse():
                    raise ValueError(
                        f"member {member.name!r} is a sparse file, whose bytes are not "
                        f"stored in one piece; rewrite the tar without sparse files"
                    )
                parts = split_name(member.name)
                if parts is None or member.name.rsplit("/", 1)[-1].startswith("__"):
                    continue
                key, ext = parts
                if member.offset_data + member.size > size:
                    raise ValueError(
                        f"the tar is truncated: member {member.name!r} needs bytes up to "
                        f"{member.offset_data + member.size}, the file has {size}"
                    )
                if not samples or samples[-1][0] != key:
                    samples.append([key, []])
                elif any(field[0] == ext for field in samples[-1][1]):
                    raise ValueError(f"duplicate field {ext!r} in sample {key!r}")
                samples[-1][1].append([ext, member.offset_data, member.size])
            end = tar.offset
        f.seek(end)
        marker = f.read(512)
    except tarfile.TarError as exc:
        raise ValueError(f"it is not a valid tar file ({exc}); is the extension wrong?") from None
    if not samples and size >= 512 and head.strip(b"\x00"):
        raise ValueError("it is not a valid tar file (no member found)")
    if len(marker) < 512 or marker.strip(b"\x00"):
        raise ValueError(
            f"the tar is truncated: no end-of-archive block after byte {end} "
            f"(the file has {size} bytes)"
        )
    return len(samples), _Members.build(samples).to_meta()


@dataclass(frozen=True)
class _Members:
    """One shard's samples in compact arrays: sample ``r`` is members
    ``first[r]:first[r + 1]``, each with a field name index, a data offset and a size."""

    keys: list[str]
    first: npt.NDArray[np.int64]
    names: tuple[str, ...]
    ext: npt.NDArray[np.int16]
    offset: npt.NDArray[np.int64]
    size: npt.NDArray[np.int64]

    @classmethod
    def build(cls, samples: list[list[Any]]) -> _Members:
        names: dict[str, int] = {}
        ext: list[int] = []
        offset: list[int] = []
        size: list[int] = []
        first = [0]
        for _, fields in samples:
            for name, off, n in fields:
                ext.append(names.setdefault(name, len(names)))
                offset.append(off)
                size.append(n)
            first.append(len(ext))
        return cls(
            keys=[key for key, _ in samples],
            first=np.asarray(first, dtype=np.int64),
            names=tuple(names),
            ext=np.asarray(ext, dtype=np.int16),
            offset=np.asarray(offset, dtype=np.int64),
            size=np.asarray(size, dtype=np.int64),
        )

    @classmethod
    def join(cls, tables: list[_Members]) -> _Members:
        """All shards' members in one table (global sample and member numbers; field
        names shared)."""
        names: dict[str, int] = {}
        ext, firsts, base = [], [np.zeros(1, dtype=np.int64)], 0
        for t in tables:
            remap = np.array([names.setdefault(x, len(names)) for x in t.names] or [0], np.int16)
            ext.append(remap[t.ext])
            firsts.append(t.first[1:] + base)
            base += int(t.first[-1])
        return cls(
            keys=[key for t in tables for key in t.keys],
            first=np.concatenate(firsts),
            names=tuple(names),
            ext=np.concatenate(ext or [np.zeros(0, np.int16)]).astype(np.int16),
            offset=np.concatenate([t.offset for t in tables] or [np.zeros(0, np.int64)]),
            size=np.concatenate([t.size for t in tables] or [np.zeros(0, np.int64)]),
        )

    def to_meta(self) -> dict[str, Any]:
        return {
            "keys": self.keys,
            "names": list(self.names),
            "first": pack_array(self.first),
            "ext": pack_array(self.ext, "<i2"),
            "offset": pack_array(self.offset),
            "size": pack_array(self.size),
        }

    @classmethod
    def from_meta(cls, meta: dict[str, Any]) -> _Members:
        return cls(
            keys=list(meta["keys"]),
            first=unpack_array(meta["first"]),
            names=tuple(meta["names"]),
            ext=unpack_array(meta["ext"], "<i2"),
            offset=unpack_array(meta["offset"]),
            size=unpack_array(meta["size"]),
        )


def from_webdataset(
    paths: Paths,
    *,
    storage_options: dict[str, Any] | None = None,
    cache_dir: str | None = None,
    cache_bytes: int | None = None,
    max_in_flight: int | None = None,
    check_fields: bool = True,
    use_manifest: bool = True,
) -> WebDatasetSource:
    """A source over uncompressed WebDataset tar shards: a list, a glob, a directory or
    an fsspec URL.  Field values are the raw bytes (decode them in ``transform``).

    ``check_fields`` raises if shards hold different sets of fields.  Remote shards are
    downloaded into a bounded local cache (``cache_dir``, ``cache_bytes``), at most
    ``max_in_flight`` requests in flight per node (default ``$EVENLY_MAX_IN_FLIGHT``,
    else 16).

    >>> import evenly
    >>> ds = evenly.Dataset(from_webdataset("s3://bucket/wds/"), shuffle=True)  # doctest: +SKIP
    """
    return WebDatasetSource(
        paths,
        storage_options=storage_options,
        cache_dir=cache_dir,
        cache_bytes=cache_bytes,
        max_in_flight=max_in_flight,
        check_fields=check_fields,
        use_manifest=use_manifest,
    )
