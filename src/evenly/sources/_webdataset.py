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
        """Read a batch: every member of every sample located in one go, then one read
        per sample (its members are consecutive in the tar), in file order."""
        idx = self._check_indices(indices)
        shards = self.shard_of(idx)
        self.prefetch(idx.tolist())
        t = self._members
        counts = t.first[idx + 1] - t.first[idx]
        starts = np.cumsum(counts) - counts
        members = np.repeat(t.first[idx] - starts, counts) + np.arange(int(counts.sum()))
        names = [t.names[e] for e in t.ext[members].tolist()]
        offsets = t.offset[members].tolist()
        sizes = t.size[members].tolist()
        bases = starts.tolist()
        out: list[Any] = [None] * idx.size
        fds: dict[int, int] = {}
        order = np.argsort(idx, kind="stable").tolist()  # shard by shard, in file order
        idx_list, shard_list, count_list = idx.tolist(), shards.tolist(), counts.tolist()
        for pos in order:
            sample, k, n, m = idx_list[pos], shard_list[pos], count_list[pos], bases[pos]
            row = sample - int(self._starts[k])
            try:
                fd = fds.get(k)
                if fd is None:
                    fd = fds[k] = self._handle(k).fileno()
                out[pos] = self._sample(k, fd, sample, row, names, offsets, sizes, m, n)
            except Exception as exc:
                raise self._error(exc, sample) from exc
        return out

    def _sample(
        self, k: int, fd: int, index: int, row: int, names: list[str], offsets: list[int],
        sizes: list[int], m: int, n: int,
    ) -> dict[str, Any]:  # fmt: skip
        """Sample ``index`` (row ``row`` of shard ``k``): its members ``m:m+n`` of the
        batch's lists."""
        key = self._members.keys[index]
        sample: dict[str, Any] = {"__key__": key, "__url__": self.urls[k]}
        if not n:
            return sample
        # one read for all its fields, from the first member's header (checked against
        # the manifest, as are the headers of the others) to the last member's end
        lo, hi = offsets[m] - 512, offsets[m + n - 1] + sizes[m + n - 1]
        span = os.pread(fd, hi - lo, lo)
        self._count(bytes_read=len(span))
        if len(span) != hi - lo:
            raise RowError(
                row,
                f"the tar is truncated: sample {key!r} needs bytes {lo}..{hi}, the file "
                f"ends at byte {lo + len(span)}",
            )
        prefix = key.encode("utf-8", "surrogateescape") + b"."
        for j in range(m, m + n):
            at = offsets[j] - lo
            h, size = at - 512, sizes[j]
            raw = prefix + names[j].encode("utf-8", "surrogateescape")
            end = h + len(raw)
            # the usual header first (the name, a NUL, the size as tarfile and GNU tar
            # write it); anything else gets the full check
            usual = (
                len(raw) < 100
                and span[end] == 0
                and span.startswith(raw, h)
                and span[h + 124 : h + 136] == b"%011o\x00" % size
            )
            if not usual and not _header_matches(span[h:at], key, names[j], size):
                raise RowError(
                    row,
                    f"the file changed since its manifest was written: sample {key!r} "
                    f"should have member {key + '.' + names[j]!r} with data at byte "
                    f"{offsets[j]}, but the tar header there does not match; open the "
                    f"dataset again (a changed file is scanned again)",
                )
            sample[names[j]] = span[at : at + size]
        return sample


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
