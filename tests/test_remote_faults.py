"""The faults of a real object store, each injected by a proxy (tests/s3proxy.py) in
front of moto's S3 server on 127.0.0.1, read through ``evenly.from_parquet`` /
``from_webdataset`` and an ``evenly.DataLoader`` with 2 real worker processes: a
connection reset mid-body, a short body, 503 SlowDown and 429, a stalled connection
(no byte for longer than the read timeout), credentials that expire (403 from then on),
a process killed mid-download, and 4 processes x 2 workers sharing one cache dir.

A transient fault is retried (first by the client library: s3fs retries a failed range
read 5 times; then by evenly's cache, with backoff, counted in ``loader.stats()``; with
obstore, whose own retries evenly turns off, every retry is evenly's); the epoch is then
exactly once.  Anything else is a clear error in the main process naming the URL; never
a hang, never a partial sample.  The tests that take ``fetch_path`` run on both clients
(the proxy tells them apart by their User-Agent)."""

from __future__ import annotations

import multiprocessing as mp
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import evenly
import evenly.sources as es
from evenly.sources._cache import ShardCache
from evenly.sources._manifest import CONNECT_TIMEOUT, READ_TIMEOUT
from tests import s3server
from tests.s3proxy import S3Proxy
from tests.s3server import S3Endpoint
from tests.sources_helpers import as_list

s3 = s3server.s3  # the fixtures: a real moto server and a fresh key prefix per test
s3_prefix = s3server.s3_prefix
fetch_path = s3server.fetch_path  # fsspec (s3fs) or obstore

SHARDS, PER_SHARD = 4, 24
N = SHARDS * PER_SHARD
#: the client's own tries of one read: this many faults in a row reach evenly's retry
#: (s3fs: ``S3FileSystem.retries``; obstore: its retries are off, every one is evenly's)
CLIENT_TRIES = {"fsspec": 5, "obstore": 1}
#: in :data:`FAULTS`: as many faults in a row as the client tries
CLIENT = 0


@pytest.fixture
def proxy(s3: S3Endpoint) -> Iterator[S3Proxy]:
    with S3Proxy(s3.endpoint_url) as p:
        yield p


def proxied(s3: S3Endpoint, proxy: S3Proxy, **config: Any) -> dict[str, Any]:
    """Storage options through the proxy; botocore's own retries off (s3fs's stay), so
    the tests see what evenly does."""
    return {
        **s3.storage_options,
        "client_kwargs": {"endpoint_url": proxy.url},
        "config_kwargs": {"retries": {"max_attempts": 0}, **config},
    }


def dataset(s3: S3Endpoint, prefix: str, tmp_path: Path, fmt: str) -> str:
    """``SHARDS`` shards of ``PER_SHARD`` samples (ids 0..N-1, ~8 KiB each) on the server."""
    rows = [{"__key__": f"k{i:04d}", "id": i, "pad": "x" * 8000} for i in range(N)]
    local = tmp_path / f"local-{fmt}"
    es.write(rows, local, format=fmt, rows_per_shard=PER_SHARD, progress=False)
    return s3.upload(str(local), f"{prefix}/{fmt}")


def open_source(url: str, fmt: str, options: dict[str, Any], cache_dir: Path) -> Any:
    read = es.from_parquet if fmt == "parquet" else es.from_webdataset
    return read(url, storage_options=options, cache_dir=str(cache_dir))


def epoch(src: Any, num_workers: int = 2, context: str | None = None) -> tuple[list[int], Any]:
    """The ids of one epoch (block shuffle) and its ``loader.stats()`` (``context``: the
    workers' start method)."""
    loader = evenly.DataLoader(
        evenly.Dataset(src, shuffle=True, seed=3, block_shards=2),
        batch_size=8,
        num_workers=num_workers,
        collate_fn=as_list,
        timeout=120 if num_workers else 0,  # a hang fails the test instead
        multiprocessing_context=context if num_workers else None,
    )
    ids = []
    for batch in loader:
        for sample in batch:
            assert len(sample["pad"]) == 8000  # whole
            ids.append(int(sample["id"]))
    return ids, loader.stats().last


def shard_clients(proxy: S3Proxy, url: str) -> set[str]:
    """The clients (User-Agent products) that sent the shards' GETs."""
    prefix = url.removeprefix("s3://") + "/shard-"
    got = proxy.stats()["agents"]
    return {c for k, by in got.items() if k.startswith(prefix) for c in by}


def shard_gets(proxy: S3Proxy, url: str) -> dict[str, int]:
    """GETs per shard the proxy received (the manifest left out)."""
    prefix = url.removeprefix("s3://")
    got = proxy.stats()["gets_by_key"]
    return {k.rsplit("/", 1)[1]: n for k, n in got.items() if k.startswith(prefix + "/shard-")}


# ---- transient faults: retried, the epoch exactly once, the retries counted -------------
#: per format, the faults of one epoch: (kind, shard, times, options); each fault is
#: injected ``times`` times (:data:`CLIENT`: the client's tries) in a row into that
#: shard's GETs
FAULTS: dict[str, list[tuple[str, int, int, dict[str, Any]]]] = {
    "parquet": [
        ("reset", 1, CLIENT, {}),  # a connection reset mid-body
        ("short", 2, CLIENT, {}),  # a body shorter than Content-Length, then close
        ("status", 3, CLIENT, {"status": 503}),  # SlowDown (s3fs retries it too)
    ],
    "webdataset": [
        ("status", 1, 2, {"status": 429}),  # s3fs does not retry a 429: evenly does
        # headers and half the body, then nothing: the read timeout (2 s here) ends
        # each try; without one the loader's timeout would fail the test
        ("stall", 2, CLIENT, {"seconds": 600}),
        ("reset", 3, CLIENT, {}),
    ],
}


@pytest.mark.parametrize("fmt", sorted(FAULTS))
def test_transient_faults_are_retried_and_counted_and_the_epoch_is_exactly_once(
    s3: S3Endpoint, s3_prefix: str, proxy: S3Proxy, tmp_path: Path, fmt: str, fetch_path: str
) -> None:
    url = dataset(s3, s3_prefix, tmp_path, fmt)
    # 2 s: a good GET on a loaded machine can pause longer than 1 s between its bytes,
    # and was then retried (4 GETs of the stalled shard where 2 are counted)
    src = open_source(url, fmt, proxied(s3, proxy, read_timeout=2.0), tmp_path / "cache")
    tries = CLIENT_TRIES[fetch_path]
    faults = [(kind, k, times or tries, kw) for kind, k, times, kw in FAULTS[fmt]]
    for kind, k, times, kw in faults:
        proxy.fault(kind, match=f"shard-{k:05d}", times=times, **kw)
    ids, stats = epoch(src, context=s3server.worker_context(fetch_path))
    assert sorted(ids) == list(range(N))  # nothing lost, nothing twice, every sample whole
    ext = "tar" if fmt == "webdataset" else fmt
    expected = {f"shard-{k:05d}.{ext}": 1 for k in range(SHARDS)}
    for _, k, times, _ in faults:
        expected[f"shard-{k:05d}.{ext}"] += times  # each faulty GET, then a good one
    assert shard_gets(proxy, url) == expected
    assert shard_clients(proxy, url) == {s3server.AGENTS[fetch_path]}
    # the client gave up after its own tries (s3fs: a 429 at once): evenly tried again,
    # counted
    retries = sum(1 if times == tries else times for _, _, times, _ in faults)
    assert stats.fetch_retries == retries
    shard_bytes = sum(p.stat().st_size for p in (tmp_path / f"local-{fmt}").glob("shard-*"))
    assert stats.bytes_fetched >= shard_bytes and stats.fetch_requests >= SHARDS + retries
    assert stats.max_in_flight_seen >= 1 and stats.fetch_seconds > 0


def test_waits_for_downloads_are_booked_as_fetch_not_as_decode(
    s3: S3Endpoint, s3_prefix: str, proxy: S3Proxy, tmp_path: Path
) -> None:
    url = dataset(s3, s3_prefix, tmp_path, "parquet")
    src = open_source(url, "parquet", proxied(s3, proxy), tmp_path / "cache")
    proxy.delay = 0.5  # a slow link: each request waits half a second
    ids, stats = epoch(src, num_workers=0)
    assert sorted(ids) == list(range(N))
    # the first shard at least is waited for whole: its GET (the listing gave its
    # size and ETag, which the download reads with If-Match)
    assert stats.fetch_seconds >= 0.5 * 0.9
    assert stats.decode_seconds < stats.fetch_seconds / 4  # decoding 24 small rows
    assert stats.fetch_retries == 0 and stats.stages["fetch"] == stats.fetch_seconds


def test_evenly_sets_a_read_timeout_for_s3_unless_the_user_does(
    s3: S3Endpoint, s3_prefix: str, proxy: S3Proxy, tmp_path: Path
) -> None:
    url = dataset(s3, s3_prefix, tmp_path, "parquet")
    options = {**s3.storage_options, "client_kwargs": {"endpoint_url": proxy.url}}
    src = open_source(url, "parquet", options, tmp_path / "c")
    assert src.cache is not None
    config = src.cache.storage_options["config_kwargs"]
    assert (config["read_timeout"], config["connect_timeout"]) == (READ_TIMEOUT, CONNECT_TIMEOUT)
    assert "config_kwargs" not in options  # the user's dict is left as it was
    mine = open_source(url, "parquet", proxied(s3, proxy, read_timeout=3), tmp_path / "c")
    assert mine.cache is not None
    assert mine.cache.storage_options["config_kwargs"]["read_timeout"] == 3


# ---- credentials that expire: not retried, a clear error naming the URL ----------------
def test_expired_credentials_are_a_clear_error_naming_the_url_in_the_main_process(
    s3: S3Endpoint, s3_prefix: str, proxy: S3Proxy, tmp_path: Path, fetch_path: str
) -> None:
    url = dataset(s3, s3_prefix, tmp_path, "parquet")
    src = open_source(url, "parquet", proxied(s3, proxy), tmp_path / "cache")
    # after a while: the first shard downloads, then every request is refused
    proxy.fault("forbidden", match="shard-", after=2, methods=("GET", "HEAD"))
    shard = re.escape(url) + r"/shard-0000\d\.parquet"
    expired = rf"{shard}: access denied .*credentials have likely expired"
    with pytest.raises(Exception, match=expired):
        epoch(src, context=s3server.worker_context(fetch_path))
    assert shard_clients(proxy, url) == {s3server.AGENTS[fetch_path]}


def test_expired_credentials_are_not_retried(
    s3: S3Endpoint, s3_prefix: str, proxy: S3Proxy, tmp_path: Path, fetch_path: str
) -> None:
    s3.fs().pipe_file(f"{s3.bucket}/{s3_prefix}/x.bin", b"x" * 1000)
    url = f"s3://{s3.bucket}/{s3_prefix}/x.bin"
    cache = ShardCache(str(tmp_path), 1 << 20, proxied(s3, proxy), backoff=0.01, url=url)
    assert cache.obstore == (fetch_path == "obstore")
    proxy.fault("forbidden", code="ExpiredToken", methods=("GET", "HEAD"))
    with pytest.raises(PermissionError, match=rf"cannot download {re.escape(url)}: access denied"):
        cache.fetch(url, "1000:x", 1000)
    assert proxy.stats()["requests"] == 1  # one HEAD (s3fs) or GET, refused; never again
    assert cache.stats()["fetch_retries"] == 0
    lock = os.path.basename(cache.path_for(url, "1000:x")) + ".lock"
    assert os.listdir(cache.cache_dir) == [lock]  # nothing cached


# ---- a process killed mid-download ---------------------------------------------------
def _read_shard(url: str, options: dict[str, Any], cache_dir: str) -> None:
    es.from_parquet(url, storage_options=options, cache_dir=cache_dir)[PER_SHARD]


def test_a_process_killed_mid_download_leaves_nothing_a_reader_trusts(
    s3: S3Endpoint, s3_prefix: str, proxy: S3Proxy, tmp_path: Path
) -> None:
    url = dataset(s3, s3_prefix, tmp_path, "parquet")
    options, cache_dir = proxied(s3, proxy), tmp_path / "cache"
    open_source(url, "parquet", options, cache_dir)  # the manifest, cached
    proxy.fault("stall", match="shard-00001", seconds=600)  # half of it, then nothing
    proc = mp.get_context("spawn").Process(target=_read_shard, args=(url, options, str(cache_dir)))
    proc.start()
    shards = cache_dir / "shards"
    key = f"{url.removeprefix('s3://')}/shard-00001.parquet"
    while not (list(shards.glob("*.part-*")) and key in proxy.stats()["gets_by_key"]):
        assert proc.is_alive()  # it cannot finish: its GET stalls for 600 s
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)  # mid-download: the .part- file open, its lock held
    proc.join()
    (part,) = shards.glob("*.part-*")
    src = open_source(url, "parquet", options, cache_dir)  # the next process (here)
    ids, _ = epoch(src)
    assert sorted(ids) == list(range(N))  # the shard was downloaded afresh, whole
    assert shard_gets(proxy, url)["shard-00001.parquet"] == 2
    assert not part.exists() and not list(shards.glob("*.part-*"))  # removed by eviction


# ---- 4 processes x 2 workers sharing one cache dir -----------------------------------
def _rank(url: str, options: dict[str, Any], cache_dir: str, cache_bytes: int, rank: int) -> None:
    src = es.from_parquet(
        url, storage_options=options, cache_dir=cache_dir, cache_bytes=cache_bytes
    )
    ds = evenly.Dataset(src, shuffle=True, seed=7, block_shards=2, rank=rank, world_size=4)
    loader = evenly.DataLoader(ds, batch_size=4, num_workers=2, collate_fn=as_list, timeout=120)
    ids = [int(s["id"]) for b in loader for s in b]
    Path(cache_dir, f"rank{rank}.txt").write_text(" ".join(map(str, ids)))


@pytest.mark.slow
def test_four_processes_of_two_workers_share_one_cache_and_download_each_shard_once(
    s3: S3Endpoint, s3_prefix: str, proxy: S3Proxy, tmp_path: Path
) -> None:
    url = dataset(s3, s3_prefix, tmp_path, "parquet")
    options, cache_dir = proxied(s3, proxy), tmp_path / "cache"
    sizes = [p.stat().st_size for p in (tmp_path / "local-parquet").glob("shard-*")]
    bound = sum(sizes)  # room for all of them: each can be downloaded once
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=_rank, args=(url, options, str(cache_dir), bound, r)) for r in range(4)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
    assert [p.exitcode for p in procs] == [0] * 4
    ranks = [(cache_dir / f"rank{r}.txt").read_text().split() for r in range(4)]
    assert len({len(r) for r in ranks}) == 1  # equal shares
    assert sorted(int(i) for r in ranks for i in r) == list(range(N))  # exactly once
    assert shard_gets(proxy, url) == {f"shard-{k:05d}.parquet": 1 for k in range(SHARDS)}
    cache = ShardCache(str(cache_dir), bound)
    assert cache.usage() <= bound and not list((cache_dir / "shards").glob("*.part-*"))
