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

from ._base import Paths, RowError, ShardedSource
from ._manifest import FileEntry, pack_array, unpack_array

__all__ = ["WebDatasetSource", "from_webdataset"]

_USTAR_MAX_SIZE = 0o77777777777
_KEY_EXT = re.compile(r"^((?:.*/|)[^./]+)[.]([^/]*)$")


def split_name(name: str) -> tuple[str, str] | None:
    """``"dir/abc.seg.png"`` -> ``("dir/abc", "seg.png")``; None for a name without a field."""
    match = _KEY_EXT.match(name)
    return None if match is None else (match.group(1), match.group(2).lower())


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
    """

    format = "webdataset"
    extensions = (".tar",)

    def __init__(self, paths: Paths, *, check_fields: bool = True, **kwargs: Any) -> None:
        self.check_fields = check_fields
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

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """Read a batch: every member of every sample located in one go, then the
        samples' spans (a sample's members are consecutive in the tar, from its first
        member's header to its last member's end) sorted by shard and offset, and spans
        at most 4 KiB apart read with one ``pread`` (up to 16 MiB each); every member's
        header is checked against the manifest.  Samples come back in the order asked."""
        idx = self._check_indices(indices)
        self.prefetch(idx.tolist())
        t = self._members
        first = t.first[idx]
        counts = t.first[idx + 1] - first
        out: list[Any] = [None] * idx.size
        shards = self.shard_of(idx)
        for pos in np.flatnonzero(counts == 0).tolist():  # a key with no field
            k = int(shards[pos])
            out[pos] = {"__key__": t.keys[int(idx[pos])], "__url__": self.urls[k]}
        full = np.flatnonzero(counts > 0)
        if not full.size:
            return out
        last = first[full] + counts[full] - 1
        # spans as positions on one line, shard after shard (2**42 bytes apart)
        base = shards[full] << 42
        lo = base + t.offset[first[full]] - 512
        hi = base + t.offset[last] + t.size[last]
        order = np.argsort(lo, kind="stable")
        lo, hi = lo[order], hi[order]
        reach = np.maximum.accumulate(hi)
        starts = np.flatnonzero(np.concatenate([[True], lo[1:] > reach[:-1] + _GAP]))
        ends = np.append(starts[1:], lo.size)
        runs = _split_long(starts.tolist(), ends.tolist(), lo, reach)
        # every member of the batch, sample by sample: sample p is members[at[p]:][:n]
        at = np.cumsum(counts) - counts
        members = np.repeat(first - at, counts) + np.arange(int(counts.sum()))
        batch = _Batch(self, idx.tolist(), shards.tolist(), counts.tolist(), at.tolist(), members)
        sorted_pos = full[order].tolist()
        mask = (1 << 42) - 1
        lo_l, reach_l = (lo & mask).tolist(), (reach & mask).tolist()
        for a, b in runs:
            batch.read(sorted_pos[a:b], lo_l[a], reach_l[b - 1], out)
        return out


#: spans of one shard at most this far apart are read with one ``pread``
_GAP = 4096
#: the most one ``pread`` reads (unless one sample alone is larger)
_MAX_RUN = 16 << 20


def _split_long(
    starts: list[int], ends: list[int], lo: npt.NDArray[np.int64], reach: npt.NDArray[np.int64]
) -> list[tuple[int, int]]:
    """The runs ``starts[i]:ends[i]`` (of spans sorted by ``lo``), those longer than
    ``_MAX_RUN`` bytes split where a read would pass it."""
    runs = []
    for a, b in zip(starts, ends, strict=True):
        if int(reach[b - 1] - lo[a]) <= _MAX_RUN:
            runs.append((a, b))
            continue
        cut = a
        for j in range(a + 1, b):
            if int(reach[j] - lo[cut]) > _MAX_RUN:
                runs.append((cut, j))
                cut = j
        runs.append((cut, b))
    return runs


class _Batch:
    """One batch's samples being read (the member tables' rows they need, as lists)."""

    def __init__(
        self, src: WebDatasetSource, idx: list[int], shards: list[int], counts: list[int],
        at: list[int], members: npt.NDArray[np.int64],
    ) -> None:  # fmt: skip
        t = src._members
        self.src, self.idx, self.shards, self.counts, self.at = src, idx, shards, counts, at
        self.ext, self.offset = t.ext[members].tolist(), t.offset[members].tolist()
        self.size = t.size[members].tolist()
        self.fields = list(t.names)
        self.dotted = [b"." + name.encode("utf-8", "surrogateescape") for name in t.names]
        self.fds: dict[int, int] = {}

    def read(self, run: list[int], lo: int, hi: int, out: list[Any]) -> None:
        """Read the samples at batch positions ``run`` (all in one shard, their spans
        within bytes ``lo..hi``) with one ``pread``, checking every member's header."""
        src = self.src
        k = self.shards[run[0]]
        try:
            fd = self.fds.get(k)
            if fd is None:
                fd = self.fds[k] = src._handle(k).fileno()
            buf = os.pread(fd, hi - lo, lo)
        except Exception as exc:
            raise src._error(exc, self.idx[run[0]]) from exc
        keys, url, stop = src._members.keys, src.urls[k], lo + len(buf)
        ext, offset, size, at, counts = self.ext, self.offset, self.size, self.at, self.counts
        fields, dotted = self.fields, self.dotted
        for pos in run:
            index = self.idx[pos]
            key = keys[index]
            m = at[pos]
            z = m + counts[pos] - 1
            if offset[z] + size[z] > stop:
                raise src._error(self._cut(k, index, m, z, stop), index)
            sample: dict[str, Any] = {"__key__": key, "__url__": url}
            prefix = key.encode("utf-8", "surrogateescape")
            for j in range(m, z + 1):
                e, n_bytes = ext[j], size[j]
                a = offset[j] - lo
                h = a - 512
                raw = prefix + dotted[e]
                # the usual header first (the name, a NUL, the size as tarfile and GNU tar
                # write it); anything else gets the full check
                if not (
                    len(raw) < 100
                    and buf[h + len(raw)] == 0
                    and buf.startswith(raw, h)
                    and buf[h + 124 : h + 136] == b"%011o\x00" % n_bytes
                ) and not _header_matches(buf[h:a], key, fields[e], n_bytes):
                    raise src._error(self._changed(k, index, key, fields[e], offset[j]), index)
                sample[fields[e]] = buf[a : a + n_bytes]
            out[pos] = sample

    def _cut(self, k: int, index: int, m: int, z: int, stop: int) -> RowError:
        row = index - int(self.src._starts[k])
        key = self.src._members.keys[index]
        return RowError(
            row,
            f"the tar is truncated: sample {key!r} needs bytes {self.offset[m] - 512}.."
            f"{self.offset[z] + self.size[z]}, the file ends at byte {stop}",
        )

    def _changed(self, k: int, index: int, key: str, field: str, offset: int) -> RowError:
        return RowError(
            index - int(self.src._starts[k]),
            f"the file changed since its manifest was written: sample {key!r} should have "
            f"member {key + '.' + field!r} with data at byte {offset}, but the tar header "
            f"there does not match; open the dataset again (a changed file is scanned again)",
        )


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


def _header_matches(header: bytes, key: str, ext: str, size: int) -> bool:
    """Whether ``header`` (the 512 bytes before a member's data) is the header of the
    member ``key.ext`` of ``size`` bytes that the manifest recorded.

    A name that a header cannot hold whole (over 100 bytes, or not ASCII, written in a
    GNU long-name or pax record before it) is checked by size and header checksum only.
    """
    name = f"{key}.{ext}"
    raw = name.encode("utf-8", "surrogateescape")
    n = len(raw)
    if n < 100 and header[n] == 0 and header.startswith(raw) and not header[124] & 0x80:
        try:  # the usual case: the whole name, and the size in octal
            if int(header[124:136].split(b"\0", 1)[0].strip() or b"0", 8) == size:
                return True
        except ValueError:
            pass
    try:
        info = tarfile.TarInfo.frombuf(header, tarfile.ENCODING, "surrogateescape")
    except tarfile.HeaderError:
        return False
    # a size over 8 GiB may live only in a pax record
    if not info.isfile() or (info.size != size and size <= _USTAR_MAX_SIZE):
        return False
    if split_name(info.name) == (key, ext):
        return True
    return len(raw) > 100 or not name.isascii()


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
    check_fields: bool = True,
    use_manifest: bool = True,
) -> WebDatasetSource:
    """A source over uncompressed WebDataset tar shards: a list, a glob, a directory or
    an fsspec URL.  Field values are the raw bytes (decode them in ``transform``).

    ``check_fields`` raises if shards hold different sets of fields.

    >>> import evenly
    >>> ds = evenly.Dataset(from_webdataset("s3://bucket/wds/"), shuffle=True)  # doctest: +SKIP
    """
    return WebDatasetSource(
        paths,
        storage_options=storage_options,
        cache_dir=cache_dir,
        cache_bytes=cache_bytes,
        check_fields=check_fields,
        use_manifest=use_manifest,
    )
