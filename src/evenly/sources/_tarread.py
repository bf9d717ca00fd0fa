"""Reading a batch of tar members: sorted, coalesced ``pread``s per shard in use, and
every member's tar header checked against the manifest with a few numpy operations for
the whole batch (not a dozen Python operations per member).

A sample's members are consecutive in its tar, so its bytes are one span, from its first
member's header to its last member's end.  The batch's spans are sorted by shard and
offset; spans at most ``GAP`` bytes apart are read with one ``pread`` (at most
``MAX_RUN`` bytes, unless one sample alone is larger), joined into one buffer for the
batch's checks.
The usual header (the name whole, then a NUL; the size in octal as tarfile and GNU tar
write it) is checked in bulk; any other (a long name in a pax or GNU record, a size in
base-256) gets the full check of :func:`header_matches`.
"""

from __future__ import annotations

import os
import re
import tarfile
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from ._base import RowError

if TYPE_CHECKING:
    from ._webdataset import WebDatasetSource

__all__ = ["GAP", "MAX_RUN", "header_matches", "read_batch", "sample_spans", "split_name"]

#: spans of one shard at most this far apart are read with one ``pread``
GAP = 4096
#: the most one read reads (unless one sample alone is larger)
MAX_RUN = 16 << 20
_USTAR_MAX_SIZE = 0o77777777777
_KEY_EXT = re.compile(r"^((?:.*/|)[^./]+)[.]([^/]*)$")
_OCTAL = 8 ** np.arange(10, -1, -1, dtype=np.int64)  # the 11 octal digits of a size
_FIELDS = 136  # a header's name (bytes 0-99) ... size (bytes 124-135) fields


def split_name(name: str) -> tuple[str, str] | None:
    """``"dir/abc.seg.png"`` -> ``("dir/abc", "seg.png")``; None for a name without a field."""
    match = _KEY_EXT.match(name)
    return None if match is None else (match.group(1), match.group(2).lower())


def header_matches(header: bytes, key: str, ext: str, size: int) -> bool:
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


def _runs(
    lo: npt.NDArray[np.int64], reach: npt.NDArray[np.int64], gap: int = GAP
) -> npt.NDArray[np.int64]:
    """Where runs start among spans sorted by ``lo`` (``reach``: the running maximum of
    their ends): where a span starts more than ``gap`` past the run, or where the run
    would pass ``MAX_RUN`` bytes."""
    starts = np.flatnonzero(np.concatenate([[True], lo[1:] > reach[:-1] + gap]))
    ends = np.append(starts[1:], lo.size)
    long = np.flatnonzero(reach[ends - 1] - lo[starts] > MAX_RUN)
    if not long.size:
        return starts
    cuts = []
    for a, b in zip(starts[long].tolist(), ends[long].tolist(), strict=True):
        low = int(lo[a])
        for j, end in enumerate(reach[a + 1 : b].tolist(), a + 1):
            if end - low > MAX_RUN:
                cuts.append(j)
                low = int(lo[j])
    return np.union1d(starts, np.asarray(cuts, dtype=np.int64))


def sample_spans(
    src: WebDatasetSource, idx: npt.NDArray[np.int64]
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """``(shard, lo, hi)`` of samples ``idx`` (checked indices): the bytes from the first
    member's header to the last member's end, as :func:`read_batch` reads them (``lo ==
    hi == 0`` for a sample with no member)."""
    t = src._members
    first, stop = t.first[idx], t.first[idx + 1]
    full = stop > first
    top = max(t.offset.size - 1, 0)
    a, z = np.minimum(first, top), np.minimum(stop - 1, top)
    lo = np.where(full, t.offset[a] - 512, 0) if t.offset.size else np.zeros_like(idx)
    hi = np.where(full, t.offset[z] + t.size[z], 0) if t.offset.size else np.zeros_like(idx)
    return src.shard_of(idx), lo.astype(np.int64), hi.astype(np.int64)


def read_batch(
    src: WebDatasetSource,
    idx: npt.NDArray[np.int64],
    fetched: dict[tuple[int, int], bytes] | None = None,
) -> list[Any]:
    """Samples ``idx`` of ``src`` (checked indices), in that order.  ``fetched``: the
    samples' spans fetched by range (keyed by ``(shard, lo)`` as :func:`sample_spans`
    gives them); then each sample is its own run, and a span not in it is read from
    the shard's local copy."""
    t = src._members
    first = t.first[idx]
    counts = t.first[idx + 1] - first
    shards = src.shard_of(idx)
    keys = [t.keys[i] for i in idx.tolist()]
    urls = src.urls
    out: list[Any] = [
        {"__key__": key, "__url__": urls[k]} for key, k in zip(keys, shards.tolist(), strict=True)
    ]
    full = np.flatnonzero(counts > 0)
    if not full.size:
        return out
    # every member of the batch, sample by sample: sample p's are members[at[p]:][:n]
    at = np.cumsum(counts) - counts
    members = np.repeat(first - at, counts) + np.arange(int(counts.sum()), dtype=np.int64)
    owner = np.repeat(np.arange(idx.size, dtype=np.int64), counts)
    offset, size, ext = t.offset[members], t.size[members], t.ext[members].astype(np.int64)
    # the spans on one line, shard after shard (2**42 bytes apart), sorted
    last = at[full] + counts[full] - 1
    base = shards[full] << 42
    lo = base + offset[at[full]] - 512
    order = np.argsort(lo, kind="stable")
    lo = lo[order]
    reach = np.maximum.accumulate((base + offset[last] + size[last])[order])
    starts = _runs(lo, reach, GAP if fetched is None else -1)
    ends = np.append(starts[1:], lo.size)
    # one buffer for the batch: run r at buffer[into[r]:], file bytes run_lo[r]..+run_len[r]
    run_lo = lo[starts] & ((1 << 42) - 1)
    run_len = reach[ends - 1] - lo[starts]
    into = np.cumsum(run_len) - run_len
    sample_run = np.empty(idx.size, dtype=np.int64)
    sample_run[full[order]] = np.repeat(np.arange(starts.size, dtype=np.int64), ends - starts)
    sorted_pos = full[order].tolist()
    run_k = shards[full[order][starts]].tolist()
    lengths, at_bytes = run_len.tolist(), run_lo.tolist()
    if fetched is not None:
        pieces = _read_runs(
            src, idx, starts.tolist(), run_k, lengths, at_bytes, sorted_pos, fetched
        )
    else:
        try:
            fds = {k: src._handle(k).fileno() for k in dict.fromkeys(run_k)}
            # one C-level loop over the runs (a Python loop costs about what a pread does)
            pieces = list(map(os.pread, map(fds.__getitem__, run_k), lengths, at_bytes))
        except Exception:  # again run by run, to name the sample whose read failed
            pieces = _read_runs(src, idx, starts.tolist(), run_k, lengths, at_bytes, sorted_pos)
    if sum(map(len, pieces)) < int(into[-1] + run_len[-1]):  # a short read: a truncated tar
        for r, (piece, n) in enumerate(zip(pieces, lengths, strict=True)):
            if len(piece) < n:
                run = (int(starts[r]), int(ends[r]))
                stop = at_bytes[r] + len(piece)
                _truncated(src, idx, shards, run, sorted_pos, offset, size, at, counts, stop)
    buffer = b"".join(pieces)
    src._count(bytes_read=len(buffer))  # loader.stats()
    # where each member's data and header lie in the buffer
    run_of = sample_run[owner]
    data = into[run_of] + offset - run_lo[run_of]
    _check_headers(src, buffer, data - 512, idx, keys, owner, ext, size, offset)
    names = t.names
    where = zip(owner.tolist(), ext.tolist(), data.tolist(), size.tolist(), strict=True)
    for p, e, d, n in where:
        out[p][names[e]] = buffer[d : d + n]
    return out


def _read_runs(
    src: WebDatasetSource,
    idx: npt.NDArray[np.int64],
    first: list[int],
    run_k: list[int],
    lengths: list[int],
    at_bytes: list[int],
    sorted_pos: list[int],
    fetched: dict[tuple[int, int], bytes] | None = None,
) -> list[bytes]:
    """The runs one by one: from ``fetched`` (one sample each, by range) where it holds
    them, else read from the shard's local file; a failing read raises naming its first
    sample."""
    pieces = []
    for a, k, n, at_byte in zip(first, run_k, lengths, at_bytes, strict=True):
        piece = None if fetched is None else fetched.get((k, at_byte))
        if piece is None:
            try:
                piece = os.pread(src._handle(k).fileno(), n, at_byte)
            except Exception as exc:
                raise src._error(exc, int(idx[sorted_pos[a]])) from exc
        pieces.append(piece[:n])
    return pieces


def _check_headers(
    src: WebDatasetSource,
    buffer: bytes,
    header: npt.NDArray[np.int64],
    idx: npt.NDArray[np.int64],
    keys: list[str],
    owner: npt.NDArray[np.int64],
    ext: npt.NDArray[np.int64],
    size: npt.NDArray[np.int64],
    offset: npt.NDArray[np.int64],
) -> None:
    """Raise, naming the sample, if a member's header is not the one the manifest
    recorded: the usual headers in bulk, the rest one by one."""
    t = src._members
    buf = np.frombuffer(buffer, dtype=np.uint8)
    # each member's name and size fields, one row per member (a header is a whole
    # 512-byte block of the buffer, so every row lies inside it)
    windows = np.lib.stride_tricks.as_strided(
        buf, shape=(max(buf.size - _FIELDS + 1, 0), _FIELDS), strides=(1, 1), writeable=False
    )
    fields = windows[header]
    dotted = [b"." + n.encode("utf-8", "surrogateescape") for n in t.names]
    key_bytes = [k.encode("utf-8", "surrogateescape") for k in keys]
    names = [key_bytes[p] + dotted[e] for p, e in zip(owner.tolist(), ext.tolist(), strict=True)]
    name_len = np.fromiter(map(len, names), dtype=np.int64, count=len(names))
    ok = (name_len < 100) & (size <= _USTAR_MAX_SIZE)
    # the name whole, then a NUL (the rest of the field is not read): the bytes up to
    # the longest name's NUL, a shorter name padded with NULs where it must have one
    width = int(min(name_len.max(), 99)) + 1
    want = np.array(names, dtype=f"S{width}").view(np.uint8).reshape(len(names), width)
    checked = np.arange(width) <= name_len[:, None]
    ok &= ((fields[:, :width] == want) | ~checked).all(1)
    # the size: 11 octal digits, then a NUL
    digits = fields[:, 124:135] - np.uint8(48)  # a byte below '0' wraps past 7
    ok &= (digits < 8).all(1) & (fields[:, 135] == 0)
    ok &= digits.astype(np.int64) @ _OCTAL == size
    for j in np.flatnonzero(~ok).tolist():
        h, p, e, n = int(header[j]), int(owner[j]), int(ext[j]), int(size[j])
        if header_matches(bytes(buffer[h : h + 512]), keys[p], t.names[e], n):
            continue
        index = int(idx[p])
        k = int(src.shard_of([index])[0])
        bad_row = RowError(
            index - int(src._starts[k]),
            f"the file changed since its manifest was written: sample {keys[p]!r} should "
            f"have member {keys[p] + '.' + t.names[e]!r} with data at byte {int(offset[j])}, "
            f"but the tar header there does not match; open the dataset again (a changed "
            f"file is scanned again)",
        )
        raise src._error(bad_row, index) from bad_row


def _truncated(
    src: WebDatasetSource,
    idx: npt.NDArray[np.int64],
    shards: npt.NDArray[np.int64],
    run: tuple[int, int],
    sorted_pos: list[int],
    offset: npt.NDArray[np.int64],
    size: npt.NDArray[np.int64],
    at: npt.NDArray[np.int64],
    counts: npt.NDArray[np.int64],
    stop: int,
) -> None:
    """Raise for the first sample of a short read that the file does not hold whole."""
    for pos in sorted_pos[run[0] : run[1]]:
        z = int(at[pos] + counts[pos] - 1)
        end = int(offset[z] + size[z])
        if end > stop:
            index = int(idx[pos])
            key = src._members.keys[index]
            cut = RowError(
                index - int(src._starts[int(shards[pos])]),
                f"the tar is truncated: sample {key!r} needs bytes "
                f"{int(offset[at[pos]]) - 512}..{end}, the file ends at byte {stop}",
            )
            raise src._error(cut, index) from cut
