"""tar batches read with sorted, coalesced ``pread``s: every member's bytes equal what
``tarfile`` extracts, whatever the member layout, the batch and the coalescing limits."""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
import tempfile
from typing import Any
from unittest import mock

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import evenly.sources as es
import evenly.sources._tarread as tarread

FIELDS = ("txt", "cls", "seg.png", "json")
SIZES = st.one_of(st.sampled_from([0, 1, 511, 512, 513, 4096, 5000]), st.integers(0, 9000))


def content(key: str, field: str, size: int) -> bytes:
    seed = hashlib.sha256(f"{key}.{field}".encode()).digest()
    return (seed * (size // 32 + 1))[:size]


@st.composite
def layouts(draw: Any) -> list[list[tuple[str, list[tuple[str, int]]]]]:
    """Shards of samples: (key, [(field, size)...]) with unique keys, some long (their
    names need a pax record), some with directories or ``__`` members in between."""
    shards = []
    for s in range(draw(st.integers(1, 3))):
        samples = []
        for i in range(draw(st.integers(1, 10))):
            long = draw(st.booleans()) and draw(st.booleans())
            key = f"d{s}/k{i:03d}" + ("_" + "x" * 110 if long else "")
            fields = draw(st.lists(st.sampled_from(FIELDS), min_size=1, max_size=4, unique=True))
            samples.append((key, [(f, draw(SIZES)) for f in fields]))
        shards.append(samples)
    return shards


def write_tars(root: str, layout: list[list[tuple[str, list[tuple[str, int]]]]]) -> None:
    for s, samples in enumerate(layout):
        with tarfile.open(os.path.join(root, f"shard-{s}.tar"), "w") as tar:
            for j, (key, fields) in enumerate(samples):
                if j % 4 == 1:  # a directory member between samples
                    info = tarfile.TarInfo(f"d{s}/dir{j}")
                    info.type = tarfile.DIRTYPE
                    tar.addfile(info)
                for field, size in fields:
                    info = tarfile.TarInfo(f"{key}.{field}")
                    info.size = size
                    tar.addfile(info, io.BytesIO(content(key, field, size)))


def extracted(root: str) -> list[dict[str, Any]]:
    """Every sample as ``tarfile`` reads it, in index order."""
    out: list[dict[str, Any]] = []
    for name in sorted(os.listdir(root)):
        if not name.endswith(".tar"):
            continue
        url = os.path.join(root, name)
        with tarfile.open(url) as tar:
            for m in tar:
                if not m.isfile():
                    continue
                key, field = m.name.split(".", 1)
                if not out or out[-1]["__key__"] != key:
                    out.append({"__key__": key, "__url__": url})
                f = tar.extractfile(m)
                assert f is not None
                out[-1][field] = f.read()
    return out


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    layout=layouts(),
    picks=st.lists(st.integers(0, 10_000), min_size=1, max_size=40),
    gap=st.sampled_from([0, 600, 4096, 1 << 30]),
    max_run=st.sampled_from([1, 3000, 16 << 20, 1 << 40]),
)
def test_coalesced_reads_return_every_members_bytes(
    layout: list[list[tuple[str, list[tuple[str, int]]]]], picks: list[int], gap: int, max_run: int
) -> None:
    with tempfile.TemporaryDirectory() as root:
        write_tars(root, layout)
        want = extracted(root)
        src = es.from_webdataset(
            root, cache_dir=os.path.join(root, "c"), use_manifest=False, check_fields=False
        )
        assert len(src) == len(want)
        batch = [p % len(want) for p in picks]
        reads = []
        real = os.pread

        def counted(fd: int, n: int, at: int) -> bytes:
            reads.append((fd, at))
            return real(fd, n, at)

        with (
            mock.patch.object(tarread, "GAP", gap),
            mock.patch.object(tarread, "MAX_RUN", max_run),
            mock.patch.object(tarread.os, "pread", counted),
        ):
            got = src.__getitems__(batch)
        assert got == [want[i] for i in batch]
        distinct = len(set(batch))
        assert len(reads) <= len(batch)
        if gap >= 1 << 30 and max_run >= 1 << 40:  # one read per shard in use
            assert len(reads) == len({int(k) for k in src.shard_of(batch)})
        if max_run == 1:  # nothing merged: one read per sample (a repeat shares it)
            assert distinct <= len(reads)
        src.close()
