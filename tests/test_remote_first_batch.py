"""The first batch of a pass from object storage (issue 28): it waits for its own bytes
only.  A real S3-compatible server (moto's, on 127.0.0.1) behind the throttling proxy of
``tests/s3proxy.py`` (a delay per request, a bandwidth cap, counters), read at the
moment the first batch is yielded: never a time.

- Parquet and WebDataset tar, block shuffle, 2 workers: the first batch's shards
  download alone (the look-ahead starts after it); then exactly once, the local order,
  one copy per shard, within 1.05x the dataset fetched with a cache of two windows.
- A forked worker's first S3 client reuses the parent's parsed service models, and the
  range reader shares the process's client.
No mock of fsspec or S3."""

from __future__ import annotations

import multiprocessing
import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import evenly
import evenly.sources as es
from evenly.sources import _manifest
from evenly.sources._webdataset import FIRST_BY_RANGE
from tests import s3server
from tests.s3proxy import S3Proxy
from tests.s3server import S3Endpoint
from tests.sources_helpers import as_list

s3 = s3server.s3  # the fixtures: a real moto server and a fresh key prefix per test
s3_prefix = s3server.s3_prefix
SHARDS, PER_SHARD, PAYLOAD, BATCH = 32, 24, 8 << 10, 16
N = SHARDS * PER_SHARD


def rows() -> Iterator[dict[str, Any]]:
    """Incompressible payloads: a Parquet shard's bytes are its samples' bytes."""
    for i in range(N):
        yield {"__key__": f"k{i:05d}", "id": str(i), "bin": random.Random(i).randbytes(PAYLOAD)}


def upload(s3: S3Endpoint, prefix: str, tmp_path: Path, fmt: str) -> tuple[Path, str]:
    """The shards and evenly's manifest beside them (opening reads no shard)."""
    local = tmp_path / "local"
    source_rows = (
        rows() if fmt == "webdataset" else ({"id": r["id"], "bin": r["bin"]} for r in rows())
    )
    es.write(source_rows, local, format=fmt, rows_per_shard=PER_SHARD, progress=False)
    return local, s3.upload(str(local), prefix)


@pytest.fixture
def proxy(s3: S3Endpoint) -> Iterator[S3Proxy]:
    # slow enough that a shard's download takes a while, fast enough for a short test
    with S3Proxy(s3.endpoint_url, delay=0.05, bandwidth=1e6) as p:
        yield p


def via(s3: S3Endpoint, proxy: S3Proxy) -> dict[str, Any]:
    return {**s3.storage_options, "client_kwargs": {"endpoint_url": proxy.url}}


def shard_bytes(local: Path, ext: str, shards: set[int]) -> int:
    return sum((local / f"shard-{k:05d}.{ext}").stat().st_size for k in shards)


def cached(cache_dir: Path) -> list[str]:
    folder = cache_dir / "shards"
    return sorted(n for n in os.listdir(folder) if not n.endswith(".lock"))


def ids(batch: list[dict[str, Any]]) -> list[int]:
    return [int(s["id"]) for s in batch]


def _loader(
    url: str,
    fmt: str,
    options: dict[str, Any],
    cache_dir: str,
    workers: int = 2,
    batch: int = BATCH,
    **kw: Any,
) -> Any:
    """2 DataLoader workers, windows of 2 shards (the first batch reads 2 shards; the
    look-ahead, had it started, would have more in flight beside them)."""
    read = es.from_parquet if fmt == "parquet" else es.from_webdataset
    src = read(url, storage_options=options, cache_dir=cache_dir, **kw)
    ds = evenly.Dataset(src, shuffle="block", seed=5, block_shards=2)
    return evenly.DataLoader(
        ds, batch_size=batch, num_workers=workers, collate_fn=as_list, timeout=60 if workers else 0
    )


@pytest.mark.parametrize("fmt", ["parquet", "webdataset"])
def test_the_first_batch_downloads_its_own_shards_alone_and_the_epoch_stays_exact(
    s3: S3Endpoint, s3_prefix: str, proxy: S3Proxy, tmp_path: Path, fmt: str
) -> None:
    """When the first batch's shards are in, the proxy has served their bytes and little
    more: the look-ahead starts after them (while the batch decodes).  Before: the next
    windows' shards downloaded beside them, sharing the link (about 5x their bytes
    served by then).
    Exactly once, in the order of the same data read locally; and with a cache of two
    windows, one file per shard in the cache and within 1.05x the dataset fetched."""
    local, url = upload(s3, s3_prefix, tmp_path, fmt)
    ext = "tar" if fmt == "webdataset" else fmt
    proxy.reset_stats()  # what opening the source read (the manifest) is not counted
    batches = iter(_loader(url, fmt, via(s3, proxy), str(tmp_path / "c")))
    first = ids(next(batches))
    ends = proxy.stats()["served_at_end"]
    seen = first + [i for b in batches for i in ids(b)]
    mine = {i // PER_SHARD for i in first}
    theirs = shard_bytes(local, ext, mine)
    names = {f"shard-{k:05d}.{ext}" for k in mine}
    # served when the last of the first batch's own GETs ended
    served = max(n for key, n in ends if key.rsplit("/", 1)[-1] in names)
    assert theirs <= served < 2 * theirs, (served, theirs)
    read = es.from_parquet if fmt == "parquet" else es.from_webdataset
    here = evenly.Dataset(read(str(local)), shuffle="block", seed=5, block_shards=2)
    loader = evenly.DataLoader(here, batch_size=BATCH, collate_fn=as_list)
    assert seen == [i for b in loader for i in ids(b)]
    assert sorted(seen) == list(range(N))  # exactly once
    two_windows = 2 * 2 * (local / f"shard-00000.{ext}").stat().st_size
    proxy.reset_stats()
    cache_dir = tmp_path / "bounded"
    bounded = _loader(url, fmt, via(s3, proxy), str(cache_dir), cache_bytes=two_windows)
    assert [i for b in bounded for i in ids(b)] == seen
    names = [n.split("-", 1)[1] for n in cached(cache_dir)]  # <digest>-shard-000kk.ext
    assert len(names) == len(set(names))  # one copy per shard
    dataset = shard_bytes(local, ext, set(range(SHARDS)))
    fetched = proxy.stats()["bytes"]
    assert dataset <= fetched <= 1.05 * dataset, fetched / dataset


def test_the_range_reader_shares_the_process_s3_client(
    s3: S3Endpoint, s3_prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The range reader (the global shuffle from S3) on s3fs uses the process's
    filesystem instance, whose client the pass start's listing made: before, it made a
    second client of its own (a fraction of a second before a worker's first batch)."""
    monkeypatch.setenv("EVENLY_OBSTORE", "0")  # s3fs's client (obstore has its own)
    _, url = upload(s3, s3_prefix, tmp_path, "webdataset")
    src = es.from_webdataset(  # 8 in flight: the client's default pool holds them
        url, storage_options=s3.storage_options, cache_dir=str(tmp_path), max_in_flight=8
    )
    ds = evenly.Dataset(src, shuffle="global", seed=1)
    assert (
        len(
            [i for b in evenly.DataLoader(ds, batch_size=BATCH, collate_fn=as_list) for i in ids(b)]
        )
        == N
    )
    reader = src._ranges
    assert reader is not None
    assert reader._fs is _manifest.filesystem(url, src._shards.storage_options)[0]


def _child_models(url: str, options: dict[str, Any], parents: set[int], out: Any) -> None:
    fs, _ = _manifest.filesystem(url, options)  # a new instance: this is another process
    session = getattr(fs, "session", None)
    loader = session.get_component("data_loader") if session is not None else None
    out.put(id(loader) in parents)  # a fork keeps the parent's objects at their addresses


def test_a_forked_worker_s3_client_reuses_the_parent_parsed_service_models(
    s3: S3Endpoint, s3_prefix: str
) -> None:
    """A forked worker's first request made a new botocore session parse its service
    models again (about 0.5 s on a busy machine, on the first batch's path)."""
    url = f"s3://{s3.bucket}/{s3_prefix}"
    options = _manifest.with_timeouts(url, s3.storage_options)
    fs, _ = _manifest.filesystem(url, options)
    fs.ls(s3.bucket)  # the parent's client: its models parsed
    parents = {  # the models of this process's S3 clients (this test's, and earlier ones)
        id(f.session.get_component("data_loader"))
        for f in _manifest._FILESYSTEMS.values()
        if getattr(f, "session", None) is not None
    }
    assert id(fs.session.get_component("data_loader")) in parents
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_child_models, args=(url, options, parents, out))
    child.start()
    try:
        assert out.get(timeout=60) is True
    finally:
        child.join(60)
    assert child.exitcode == 0


@pytest.mark.parametrize("fmt", ["parquet", "webdataset"])
def test_the_shards_are_listed_once_before_the_first_batch_and_again_at_the_next_pass(
    s3: S3Endpoint, s3_prefix: str, proxy: S3Proxy, tmp_path: Path, fmt: str
) -> None:
    """Opening the source lists the shards; the first pass start, moments later in the
    same process, uses that listing (a shard changed since is caught by its read: the
    test below), and the workers read that pass without listing them again.  Before: the
    pass start listed them a second time, and earlier each worker made an S3 client of
    its own and listed them again, all on the first batch's path.  When the first batch
    is yielded, the proxy has served one listing: the open's.  The next pass start lists
    them again (a change between epochs is caught there)."""
    _, url = upload(s3, s3_prefix, tmp_path, fmt)
    proxy.reset_stats()
    loader = _loader(url, fmt, via(s3, proxy), str(tmp_path / "c"))
    batches = iter(loader)
    next(batches)
    stats = proxy.stats()
    # one listing (the open's); what else a worker's client asks (s3fs, which a worker
    # forked after its parent used obstore reads with, asks a HEAD per object) is not one
    assert stats["listings"] == 1, stats
    for _ in batches:
        pass
    proxy.reset_stats()
    again = iter(loader)
    next(again)
    assert proxy.stats()["listings"] == 1  # the second pass start's
    for _ in again:
        pass


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_shard_replaced_between_the_open_and_the_first_pass_is_an_error_naming_it(
    s3: S3Endpoint, s3_prefix: str, tmp_path: Path, num_workers: int
) -> None:
    """The first pass start does not list the shards again (the test above): a shard
    replaced (same size, a new ETag) after the open is caught by its read, which carries
    the listed version, and nothing of the new object is served or cached."""
    local, url = upload(s3, s3_prefix, tmp_path, "webdataset")
    cache_dir = tmp_path / "c"
    loader = _loader(url, "webdataset", s3.storage_options, str(cache_dir), num_workers, BATCH)
    victim = local / "shard-00007.tar"
    data = bytearray(victim.read_bytes())
    data[512 : 512 + 8] = b"replaced"  # the first member's data: a new ETag, same size
    s3.fs().pipe_file(f"{url.removeprefix('s3://')}/shard-00007.tar", bytes(data))
    served: list[int] = []
    with pytest.raises((ValueError, RuntimeError), match=r"shard-00007\.tar.*changed"):
        for batch in loader:
            served.extend(ids(batch))
    assert not [i for i in served if i // PER_SHARD == 7]
    assert not [n for n in cached(cache_dir) if "shard-00007" in n]  # no copy, no part


def test_a_tar_first_batch_reads_its_own_members_by_range_then_the_shards_download(
    s3: S3Endpoint, s3_prefix: str, tmp_path: Path
) -> None:
    """A block shuffle's first batch has a few samples of every shard of its window
    (here 4 of a window's 48, under ``FIRST_BY_RANGE`` of its bytes): it reads those
    samples' members by range, not their whole shards, which download after it (and every
    later batch reads them from the cache).  When the first batch is yielded, the proxy
    has served less than its shards' bytes (before: all of them); then the epoch is
    exactly once, in the local order, each shard downloaded once into the cache.  (The
    test above: a first batch of a third of its shards reads them whole.)"""
    small = 4
    assert small * (PAYLOAD + 3 * 512) < 2 * PER_SHARD * PAYLOAD * FIRST_BY_RANGE
    local, url = upload(s3, s3_prefix, tmp_path, "webdataset")
    cache_dir = tmp_path / "c"
    # one worker: nothing else reads; slow enough that the look-ahead started after the
    # batch has served little when the batch reaches the loop
    with S3Proxy(s3.endpoint_url, delay=0.05, bandwidth=0.5e6) as proxy:
        loader = _loader(url, "webdataset", via(s3, proxy), str(cache_dir), 1, small)
        proxy.reset_stats()
        batches = iter(loader)
        first = ids(next(batches))
        served = proxy.stats()["bytes"]
        seen = first + [i for b in batches for i in ids(b)]
    theirs = shard_bytes(local, "tar", {i // PER_SHARD for i in first})
    assert small * PAYLOAD <= served < theirs / 2, (served, theirs)
    here = evenly.Dataset(es.from_webdataset(str(local)), shuffle="block", seed=5, block_shards=2)
    loader = evenly.DataLoader(here, batch_size=small, collate_fn=as_list)
    assert seen == [i for b in loader for i in ids(b)]
    assert sorted(seen) == list(range(N))  # exactly once
    names = [n.split("-", 1)[1] for n in cached(cache_dir)]
    assert sorted(names) == [f"shard-{k:05d}.tar" for k in range(SHARDS)]  # whole, once each


def test_opening_a_directory_of_objects_lists_it_once(
    s3: S3Endpoint, s3_prefix: str, proxy: S3Proxy, tmp_path: Path
) -> None:
    """A remote directory is listed at once: one listing request (then the manifest's
    GET) before the first batch can be planned.  Before: a HEAD of the path and a listing
    of one key (s3fs's ``info``: is it a directory?), then the listing of its files.  A
    URL of one object is still that object alone."""
    _, url = upload(s3, s3_prefix, tmp_path, "parquet")
    options = via(s3, proxy)
    src = es.from_parquet(url, storage_options=options, cache_dir=str(tmp_path / "c"))
    stats = proxy.stats()
    assert len(src) == N
    assert stats["requests"] - sum(stats["gets_by_key"].values()) == 1, stats["requests"]
    one = es.from_parquet(
        f"{url}/shard-00003.parquet", storage_options=options, cache_dir=str(tmp_path / "c")
    )
    assert len(one) == PER_SHARD and one.urls == (f"{url}/shard-00003.parquet",)
    assert [int(s["id"]) for s in as_list([one[0], one[PER_SHARD - 1]])] == [72, 95]
