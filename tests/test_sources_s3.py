"""Remote shards on a real S3-compatible server (moto's server mode on 127.0.0.1), read
through fsspec/s3fs: exactly-once for each format, and the shard cache's promises
(one download per machine, no partial file ever visible, LRU under a byte limit,
prefetch, paths inside the cache dir).  No mock of fsspec or S3."""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
from pathlib import Path
from typing import Any

import pytest

import evenly.sources as es
from evenly.errors import EvenlyWarning
from evenly.sources._cache import ShardCache
from evenly.sources._jsonl import JsonlSource
from tests import s3server
from tests.s3server import S3Endpoint
from tests.sources_helpers import check_exactly_once, epoch_over_ranks

s3 = s3server.s3  # the fixtures: a real moto server and a fresh key prefix per test
s3_prefix = s3server.s3_prefix
N = 64
READERS = {"parquet": es.from_parquet, "webdataset": es.from_webdataset, "jsonl": es.from_jsonl}


def upload(s3: S3Endpoint, prefix: str, tmp_path: Path, fmt: str) -> str:
    local = tmp_path / f"local-{fmt}"
    rows = [{"id": i, "txt": f"sample {i}"} for i in range(N)]
    if fmt == "webdataset":
        rows = [{"__key__": f"k{i:03d}", **r} for i, r in enumerate(rows)]
    es.write(rows, local, format=fmt, rows_per_shard=16, progress=False)
    return s3.upload(str(local), f"{prefix}/{fmt}")


def sample_id(sample: dict[str, Any]) -> int:
    return int(sample["id"])


@pytest.mark.parametrize("fmt", READERS)
def test_exactly_once_remote(s3: S3Endpoint, s3_prefix: str, tmp_path: Path, fmt: str) -> None:
    url = upload(s3, s3_prefix, tmp_path, fmt)
    src = READERS[fmt](url, storage_options=s3.storage_options, cache_dir=str(tmp_path / "c"))
    assert src.preferred_shuffle == "block"
    if fmt == "parquet":  # the manifest written locally by evenly.write matched by ETag
        assert src.cache is not None and src.cache.downloads == 0
    assert src.shard_sizes == (16, 16, 16, 16)
    assert src.locate(17) == f"{url}/shard-00001{src.extensions[0]} row 1"
    # a batch over several shards in the parent starts prefetch threads; forked workers
    # must not wait on them
    assert [
        s["id"] if fmt != "webdataset" else int(s["id"]) for s in src.__getitems__([0, 20, 40])
    ] == [0, 20, 40]
    # shuffle=True: the source's preferred mode, the block shuffle for remote shards
    (ranks,) = epoch_over_ranks(src, world_size=2, batch_size=4, num_workers=2, block_shards=2)
    key = sample_id if fmt != "webdataset" else (lambda s: int(s["id"]))
    check_exactly_once(ranks, list(range(N)), key=key)


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_an_unwritable_cache_dir_for_remote_shards_is_named_when_the_source_opens(
    s3: S3Endpoint, s3_prefix: str, tmp_path: Path, fmt: str
) -> None:
    """A remote source needs its shard cache: a ``cache_dir`` that cannot be created is
    an error naming the blocking file and the setting when the source opens (it was a
    bare ``NotADirectoryError`` from a download thread at the first batch)."""
    url = upload(s3, s3_prefix, tmp_path, fmt)
    (tmp_path / "afile").write_text("not a directory")
    with pytest.raises(OSError, match="cache_dir") as raised:
        READERS[fmt](
            url, storage_options=s3.storage_options, cache_dir=str(tmp_path / "afile" / "c")
        )
    message = str(raised.value)
    assert f"{tmp_path / 'afile'} is a file, not a directory" in message, message
    assert "pass cache_dir= a writable local directory" in message, message


def test_decoded_cache_bytes_for_remote_parquet_is_named_as_not_its_bound(
    s3: S3Endpoint, s3_prefix: str, tmp_path: Path
) -> None:
    """A remote Parquet source decodes its row groups once per node into the shard
    cache, bounded by ``cache_bytes``: an explicit ``decoded_cache_bytes`` does not bound
    it, and says so instead of being ignored silently; ``0`` turns the decoded copy off
    and says nothing."""
    url = upload(s3, s3_prefix, tmp_path, "parquet")
    with pytest.warns(EvenlyWarning, match=r"decoded_cache_bytes=1048576 does not bound remote"):
        src = es.from_parquet(
            url,
            storage_options=s3.storage_options,
            cache_dir=str(tmp_path / "c"),
            decoded_cache_bytes=1 << 20,
        )
    assert src.decoded_cache is not None and src[5]["id"] == 5
    assert src.cache is not None and src.decoded_cache.dir == src.cache.cache_dir
    quiet = es.from_parquet(  # warnings are errors in this suite
        url,
        storage_options=s3.storage_options,
        cache_dir=str(tmp_path / "c"),
        decoded_cache_bytes=0,
    )
    assert quiet.decoded_cache is None


def test_manifest_cached_for_remote(
    s3: S3Endpoint, s3_prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = upload(s3, s3_prefix, tmp_path, "jsonl")
    s3.fs().rm(f"{url}/.evenly-manifest.json")  # so the first open must scan
    scanned: list[str] = []
    real = JsonlSource._scan

    def counting(self: JsonlSource, k: int, u: str) -> tuple[int, dict[str, Any]]:
        scanned.append(u)
        return real(self, k, u)

    monkeypatch.setattr(JsonlSource, "_scan", counting)
    options: dict[str, Any] = {"storage_options": s3.storage_options, "cache_dir": str(tmp_path)}
    es.from_jsonl(url, **options)
    assert len(scanned) == 4
    src = es.from_jsonl(url, **options)
    assert len(scanned) == 4 and len(src) == N
    assert src.cache is not None and src.cache.downloads == 0


def _fetch_all(cache_dir: str, options: dict[str, Any], urls: list[str], barrier: Any) -> int:
    cache = ShardCache(cache_dir, 1 << 30, options)
    barrier.wait()
    for url in urls:
        cache.fetch(url)
    return cache.downloads


def test_two_processes_never_download_one_shard_twice(
    s3: S3Endpoint, s3_prefix: str, tmp_path: Path
) -> None:
    url = upload(s3, s3_prefix, tmp_path, "parquet")
    urls = [f"{url}/shard-{k:05d}.parquet" for k in range(4)]
    ctx = mp.get_context("fork")
    barrier = ctx.Manager().Barrier(2)
    with ctx.Pool(2) as pool:
        args = (str(tmp_path / "c"), s3.storage_options, urls, barrier)
        counts = pool.starmap(_fetch_all, [args, args])
    assert sum(counts) == 4, counts  # each shard downloaded by exactly one process
    cache = ShardCache(str(tmp_path / "c"), 1 << 30, s3.storage_options)
    assert all(os.path.exists(cache.path_for(u)) for u in urls)


def test_partial_download_never_visible(s3: S3Endpoint, s3_prefix: str, tmp_path: Path) -> None:
    size = 8 << 20
    s3.fs().pipe_file(f"{s3.bucket}/{s3_prefix}/big.bin", os.urandom(size))
    cache = ShardCache(str(tmp_path / "c"), 1 << 30, s3.storage_options)
    url = f"s3://{s3.bucket}/{s3_prefix}/big.bin"
    target = cache.path_for(url)
    seen: list[int] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            try:
                seen.append(os.stat(target).st_size)
            except FileNotFoundError:
                seen.append(-1)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        assert cache.fetch(url) == target
    finally:
        done.set()
        watcher.join()
    assert -1 in seen  # the watcher ran while the download was in flight
    assert set(seen) <= {-1, size}
    assert [n for n in os.listdir(cache.cache_dir) if ".part-" in n] == []


def test_lru_eviction_under_byte_limit(s3: S3Endpoint, s3_prefix: str, tmp_path: Path) -> None:
    fs = s3.fs()
    urls = []
    for k in range(4):
        fs.pipe_file(f"{s3.bucket}/{s3_prefix}/s{k}.bin", bytes([k]) * 1000)
        urls.append(f"s3://{s3.bucket}/{s3_prefix}/s{k}.bin")
    cache = ShardCache(str(tmp_path / "c"), 2500, s3.storage_options)
    paths = [cache.path_for(u) for u in urls]
    for u in urls[:3]:
        cache.fetch(u)
    assert [os.path.exists(p) for p in paths] == [False, True, True, False]
    cache.fetch(urls[1])  # a hit makes shard 1 the most recently used
    cache.fetch(urls[3])
    assert [os.path.exists(p) for p in paths] == [False, True, False, True]
    assert cache.usage() <= 2500 and cache.downloads == 4


def test_cache_paths_stay_inside_the_cache_dir(tmp_path: Path) -> None:
    cache = ShardCache(str(tmp_path / "c"), 1 << 20)
    for url in ["s3://b/../../../etc/passwd", "s3://b/..", "https://h/a/%2e%2e/x", "s3://b/.x"]:
        path = cache.path_for(url)
        assert os.path.dirname(path) == cache.cache_dir
        assert not os.path.basename(path).startswith(".")


def test_prefetch_downloads_upcoming_shards(s3: S3Endpoint, s3_prefix: str, tmp_path: Path) -> None:
    url = upload(s3, s3_prefix, tmp_path, "parquet")
    src = es.from_parquet(url, storage_options=s3.storage_options, cache_dir=str(tmp_path / "c"))
    assert src.cache is not None and src.cache.downloads == 0  # footers read in place
    src.prefetch([40, 50, 33])  # shard 2 only
    src.prefetch([60])  # shard 3
    local = [os.path.basename(src.local_path(k)) for k in (2, 3)]  # joins the prefetches
    assert src.cache.downloads == 2
    # lock files may stay or go (filelock versions differ); nothing else is there
    held = sorted(n for n in os.listdir(src.cache.cache_dir) if not n.endswith(".lock"))
    assert held == sorted(local)
    assert src[41]["id"] == 41 and src.cache.downloads == 2  # read from the prefetched copy


def test_uploaded_manifest_is_reused(
    s3: S3Endpoint, s3_prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = upload(s3, s3_prefix, tmp_path, "webdataset")
    monkeypatch.setattr(es.WebDatasetSource, "_scan", None)  # any scan would fail
    src = es.from_webdataset(url, storage_options=s3.storage_options, cache_dir=str(tmp_path))
    assert len(src) == N and src.cache is not None and src.cache.downloads == 0
