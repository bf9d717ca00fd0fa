"""Remote Parquet decoded once per node (issue 28's memory and disk goals): a real
S3-compatible server (moto's, on 127.0.0.1) behind the counting proxy of
``tests/s3proxy.py``, read by a loader with 2 real DataLoader workers (block shuffle:
both workers read every window).

- Each row group is decoded once per node (``loader.stats().cache_misses``: decodes,
  summed over the workers) into the shard cache and mapped by both workers; once every
  row group of a shard is decoded, the downloaded shard is dropped: the cache holds one
  copy per shard, the decoded one, about the bytes of the data.
- A second epoch maps the decoded rows: nothing downloaded, nothing decoded.
- A cache of two windows stays exact, fetches each shard once (<= 1.05x the dataset)
  and decodes each row group once, and ends within its bound.
No mock of fsspec or S3."""

from __future__ import annotations

import contextlib
import os
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import evenly
import evenly.sources as es
from evenly.sources._cache import ShardCache
from evenly.sources._parquet import KEEP_DECODED_RATIO
from tests import s3server
from tests.s3proxy import S3Proxy
from tests.s3server import S3Endpoint
from tests.sources_helpers import as_list

s3 = s3server.s3  # the fixtures: a real moto server and a fresh key prefix per test
s3_prefix = s3server.s3_prefix
SHARDS, PER_SHARD, GROUP, PAYLOAD, WINDOW = 8, 64, 16, 4 << 10, 2
N, GROUPS = SHARDS * PER_SHARD, SHARDS * PER_SHARD // GROUP
#: a decoded row group's name in the shard cache: ``<shard's name>@rg<g>-<hash>.arrow``
ENTRY_MARK = "@"


def payload(i: int) -> bytes:
    """Incompressible: a Parquet shard's bytes are about its samples' bytes."""
    return random.Random(i).randbytes(PAYLOAD)


def upload(s3: S3Endpoint, prefix: str, tmp_path: Path) -> tuple[Path, str]:
    local = tmp_path / "local"
    rows = ({"id": i, "bin": payload(i)} for i in range(N))
    es.write(rows, local, rows_per_shard=PER_SHARD, row_group_size=GROUP, progress=False)
    return local, s3.upload(str(local), prefix)


@pytest.fixture
def proxy(s3: S3Endpoint) -> Iterator[S3Proxy]:
    with S3Proxy(s3.endpoint_url, delay=0.01) as p:
        yield p


def loader_for(
    url: str, options: dict[str, Any], cache_dir: Path, loader_kw: Any = None, **kw: Any
) -> Any:
    loader_kw = loader_kw or {}
    src = es.from_parquet(url, storage_options=options, cache_dir=str(cache_dir), **kw)
    ds = evenly.Dataset(src, shuffle="block", seed=7, block_shards=WINDOW)
    return evenly.DataLoader(
        ds, batch_size=8, num_workers=2, collate_fn=as_list, timeout=120, **loader_kw
    )


def read_epoch(loader: Any) -> list[int]:
    ids = []
    for batch in loader:
        for sample in batch:
            assert sample["bin"] == payload(sample["id"]), sample["id"]  # whole, its own
            ids.append(int(sample["id"]))
    return ids


def files(cache_dir: Path) -> dict[str, int]:
    """The shard cache's files (no locks) and their bytes (none removed meanwhile)."""
    out = {}
    with os.scandir(cache_dir / "shards") as it:
        for e in it:
            if not e.name.endswith(".lock"):
                with contextlib.suppress(FileNotFoundError):
                    out[e.name] = e.stat().st_size
    return out


def dataset_bytes(local: Path) -> int:
    return sum(p.stat().st_size for p in local.glob("shard-*.parquet"))


def check_one_copy(cache_dir: Path, local: Path) -> None:
    """Per shard: an empty marker (the download dropped) and its row groups decoded,
    about the bytes of the data in all."""
    held = files(cache_dir)
    shards = {n: size for n, size in held.items() if n.endswith(".parquet")}
    decoded = {n: size for n, size in held.items() if ENTRY_MARK in n}
    assert len(shards) == SHARDS and set(shards.values()) == {0}, shards
    assert len(decoded) == GROUPS, sorted(decoded)
    assert {n.partition(ENTRY_MARK)[0] for n in decoded} == set(shards)
    assert set(held) == set(shards) | set(decoded)  # no part left, nothing else
    data = dataset_bytes(local)
    assert sum(decoded.values()) <= 1.05 * data, sum(decoded.values()) / data


@pytest.mark.parametrize("start", ["fork", "spawn"])
def test_two_workers_decode_each_row_group_once_and_a_second_epoch_only_maps(
    s3: S3Endpoint, s3_prefix: str, proxy: S3Proxy, tmp_path: Path, start: str
) -> None:
    """Both workers read every window; each row group is decoded by one of them into
    the shard cache and mapped by the other.  Before: each worker decoded every row
    group of its windows (about twice the row groups), and again in every epoch."""
    local, url = upload(s3, s3_prefix, tmp_path)
    options = {**s3.storage_options, "client_kwargs": {"endpoint_url": proxy.url}}
    cache_dir = tmp_path / "c"
    loader = loader_for(url, options, cache_dir, {"multiprocessing_context": start})
    proxy.reset_stats()
    first = read_epoch(loader)
    assert sorted(first) == list(range(N))  # exactly once
    stats = loader.stats().last
    assert stats.cache_misses == GROUPS, stats  # decoded once per node
    assert proxy.stats()["bytes"] <= 1.05 * dataset_bytes(local)
    check_one_copy(cache_dir, local)

    proxy.reset_stats()
    loader.set_epoch(1)
    second = read_epoch(loader)
    assert sorted(second) == list(range(N)) and second != first
    stats = loader.stats().last
    assert (stats.cache_misses, stats.bytes_fetched) == (0, 0), stats  # mapped
    assert not any(".parquet" in key for key in proxy.stats()["gets_by_key"])
    check_one_copy(cache_dir, local)


def test_a_cache_of_two_windows_fetches_and_decodes_each_shard_once_within_its_bound(
    s3: S3Endpoint, s3_prefix: str, proxy: S3Proxy, tmp_path: Path
) -> None:
    """The decoded row groups count against ``cache_bytes`` with the downloads: with a
    cache of two windows the epoch is exact and in the local order, each shard fetched
    once (no row group evicted before both workers read it), each row group decoded
    once, and the cache ends within its bound."""
    local, url = upload(s3, s3_prefix, tmp_path)
    options = {**s3.storage_options, "client_kwargs": {"endpoint_url": proxy.url}}
    # two windows of the largest shard: each worker's shards read last (half the cache)
    # then hold a window whatever the few bytes between the shards' sizes
    shard = max(p.stat().st_size for p in local.glob("shard-*.parquet"))
    bound = 2 * WINDOW * shard
    cache_dir = tmp_path / "c"
    loader = loader_for(url, options, cache_dir, cache_bytes=bound)
    proxy.reset_stats()
    stop, usage = threading.Event(), [0]

    def watch() -> None:
        while not stop.is_set():
            usage.append(sum(files(cache_dir).values()) if (cache_dir / "shards").exists() else 0)
            time.sleep(0.005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        seen = read_epoch(loader)
    finally:
        stop.set()
        watcher.join()
    here = evenly.Dataset(es.from_parquet(str(local)), shuffle="block", seed=7, block_shards=2)
    assert seen == read_epoch(evenly.DataLoader(here, batch_size=8, collate_fn=as_list))
    data = dataset_bytes(local)
    fetched = proxy.stats()["bytes"]
    assert data <= fetched <= 1.05 * data, fetched / data
    assert loader.stats().last.cache_misses == GROUPS
    held = files(cache_dir)
    # during the epoch and at its end: the bound, plus the window the workers read, with
    # its decoded copy (at most KEEP_DECODED_RATIO of its bytes and a few KiB per row
    # group), as docs/formats.md "Remote storage" states it
    decoded = int(KEEP_DECODED_RATIO * shard) + (PER_SHARD // GROUP) * (8 << 10)
    most = bound + WINDOW * (shard + decoded)
    assert max([*usage, sum(held.values())]) <= most, (max(usage), bound, most)
    # the readers gone, the next eviction (the next write's) brings it within the bound
    ShardCache(str(cache_dir), bound, options).evict()
    held = files(cache_dir)
    assert sum(held.values()) <= bound, (sum(held.values()), bound)
    assert not [n for n in held if ".part-" in n]
    # whatever the cache kept is one copy: a shard whose row groups are all decoded
    # kept only as its marker
    for name, size in held.items():
        if name.endswith(".parquet") and size:
            assert sum(1 for n in held if n.startswith(name + ENTRY_MARK)) < PER_SHARD // GROUP
    assert os.path.isdir(cache_dir / "shards")


def test_a_row_group_decoding_to_far_more_than_its_bytes_is_not_written_to_the_cache(
    s3: S3Endpoint, s3_prefix: str, proxy: S3Proxy, tmp_path: Path
) -> None:
    """A dictionary-encoded column (one value repeated) looks uncompressed by the footer
    (its encoded bytes are about its stored bytes) but decodes to many times its bytes:
    writing that copy would pass ``cache_bytes`` unseen (the look-ahead counts the
    footer's size).  Such a row group is decoded by each worker that reads it, not
    written; the shards stay as downloaded; the epoch is exact."""
    local = tmp_path / "local"
    value = random.Random(0).randbytes(2000)  # one incompressible value, in every row
    rows = ({"id": i, "bin": value} for i in range(N))
    es.write(rows, local, rows_per_shard=PER_SHARD, row_group_size=GROUP, progress=False)
    url = s3.upload(str(local), s3_prefix)
    options = {**s3.storage_options, "client_kwargs": {"endpoint_url": proxy.url}}
    cache_dir = tmp_path / "c"
    src = es.from_parquet(url, storage_options=options, cache_dir=str(cache_dir))
    ds = evenly.Dataset(src, shuffle="block", seed=7, block_shards=WINDOW)
    loader = evenly.DataLoader(ds, batch_size=8, num_workers=2, collate_fn=as_list, timeout=120)
    ids = []
    for batch in loader:
        for sample in batch:
            assert sample["bin"] == value, sample["id"]
            ids.append(int(sample["id"]))
    assert sorted(ids) == list(range(N))
    held = files(cache_dir)
    assert not [n for n in held if ENTRY_MARK in n], sorted(held)  # no decoded copy
    shards = {n: size for n, size in held.items() if n.endswith(".parquet")}
    assert shards and all(size > 0 for size in shards.values())  # none retired
    assert sum(held.values()) <= dataset_bytes(local)
