"""The global shuffle straight from object storage: remote WebDataset tar shards on a
real S3-compatible server (moto's server mode on 127.0.0.1, through fsspec/s3fs) read
by byte range under ``shuffle="global"``: no shard is downloaded into the cache, the
order is the one the same data gives locally with the same seed, every sample once over
2 gloo ranks x 2 DataLoader workers, bytes fetched within 1.2x the dataset, and an object
replaced mid-epoch raises naming its URL (S3 ``If-Match``).  No mock of fsspec or S3.
The tests that take ``fetch_path`` run on both clients (fsspec/s3fs and obstore)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest

import evenly
import evenly.sources as es
from evenly.sources import _ranges
from tests import s3server
from tests.distributed import run_ranks
from tests.s3server import S3Endpoint
from tests.sources_helpers import as_list, check_exactly_once, epoch_over_ranks

s3 = s3server.s3  # the fixtures: a real moto server and a fresh key prefix per test
s3_prefix = s3server.s3_prefix
fetch_path = s3server.fetch_path  # fsspec (s3fs) or obstore
N, PER_SHARD, PAYLOAD = 96, 12, 12 << 10


def rows(fill: bytes = b"") -> list[dict[str, Any]]:
    """Samples of ~12 KiB (so only neighbours are coalesced); ``fill`` makes other
    bytes of the same sizes (the same tar layout)."""
    out = []
    for i in range(N):
        seed = (fill or b"old") + i.to_bytes(4, "little")
        payload = (seed * (PAYLOAD // len(seed) + 1))[:PAYLOAD]
        out.append({"__key__": f"k{i:04d}", "id": str(i), "bin": payload})
    return out


def write_local(tmp_path: Path, fill: bytes = b"", name: str = "local") -> Path:
    local = tmp_path / name
    es.write(rows(fill), local, format="webdataset", rows_per_shard=PER_SHARD, progress=False)
    return local


def upload(s3: S3Endpoint, prefix: str, local: Path) -> str:
    """The shards and evenly's manifest beside them (so opening downloads nothing)."""
    return s3.upload(str(local), prefix)


def dataset_bytes(local: Path) -> int:
    return sum(p.stat().st_size for p in local.glob("*.tar"))


def cached_shards(cache_dir: Path) -> list[str]:
    shards = cache_dir / "shards"
    return [n for n in os.listdir(shards) if not n.endswith(".lock")] if shards.exists() else []


def ids(batches: list[list[dict[str, Any]]]) -> list[int]:
    return [int(s["id"]) for b in batches for s in b]


def order(source: Any, seed: int) -> list[int]:
    """The ids of one epoch of a global shuffle, in the order served (0 workers)."""
    ds = evenly.Dataset(source, shuffle="global", seed=seed)
    return ids(list(evenly.DataLoader(ds, batch_size=8, collate_fn=as_list)))


def remote_source(s3: S3Endpoint, url: str, cache_dir: Path) -> es.WebDatasetSource:
    # a cache far smaller than the data: shards downloaded whole could not all stay
    return es.from_webdataset(
        url, storage_options=s3.storage_options, cache_dir=str(cache_dir), cache_bytes=64 << 10
    )


def test_a_global_shuffle_from_s3_reads_by_range_in_the_local_order(
    s3: S3Endpoint,
    s3_prefix: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    fetch_path: str,
) -> None:
    local = write_local(tmp_path)
    url = upload(s3, s3_prefix, local)
    cache_dir = tmp_path / "c"
    src = remote_source(s3, url, cache_dir)
    monkeypatch.setattr(_ranges, "READ_AHEAD_BATCHES", 2)  # not the whole epoch at once
    seen = order(src, seed=7)
    assert seen == order(es.from_webdataset(str(local)), seed=7)
    assert sorted(seen) == list(range(N))
    assert cached_shards(cache_dir) == []  # nothing downloaded whole
    stats = src.io_stats()
    assert stats["fetch_requests"] > N // PER_SHARD  # many ranges, not a request per shard
    assert 0 < stats["bytes_fetched"] <= 1.2 * dataset_bytes(local)
    assert stats["fetch_seconds"] >= 0
    assert src._ranges is not None
    assert (src._ranges._store is not None) == (fetch_path == "obstore")  # that client read


def _rank_epoch(
    rank: int, world_size: int, url: str, options: dict[str, Any], cache_dir: str
) -> tuple[list[list[int]], bool | None]:
    """One gloo rank's epoch of a global shuffle from S3, 2 DataLoader workers; and
    whether its workers were told to read with obstore."""
    src = es.from_webdataset(url, storage_options=options, cache_dir=cache_dir, cache_bytes=1 << 16)
    ds = evenly.Dataset(src, shuffle="global", seed=3)
    loader = evenly.DataLoader(ds, batch_size=8, num_workers=2, collate_fn=as_list, timeout=60)
    assert src.cache is not None
    return [[int(s["id"]) for s in batch] for batch in loader], src.cache.obstore


def test_a_global_shuffle_from_s3_is_exactly_once_over_2_gloo_ranks_and_2_workers(
    s3: S3Endpoint, s3_prefix: str, tmp_path: Path, fetch_path: str
) -> None:
    local = write_local(tmp_path)
    url = upload(s3, s3_prefix, local)
    cache_dir = tmp_path / "c"
    env = {"EVENLY_OBSTORE": os.environ["EVENLY_OBSTORE"]}  # the ranks start from a fork server
    got = run_ranks(_rank_epoch, 2, url, s3.storage_options, str(cache_dir), env=env, timeout=300)
    assert [obstore for _, obstore in got] == [fetch_path == "obstore"] * 2
    ranks = [batches for batches, _ in got]
    check_exactly_once(ranks, list(range(N)), key=int)
    assert cached_shards(cache_dir) == []  # every worker of every rank read by range
    kw: dict[str, Any] = dict(world_size=2, batch_size=8, num_workers=0, shuffle="global", seed=3)
    (local_ranks,) = epoch_over_ranks(es.from_webdataset(str(local)), **kw)
    assert ranks == [[[int(s["id"]) for s in b] for b in r] for r in local_ranks]


def test_an_object_replaced_mid_epoch_raises_naming_it(
    s3: S3Endpoint,
    s3_prefix: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    fetch_path: str,
) -> None:
    """The replacement has the same members at the same offsets (only the bytes
    differ), so the tar headers still match: only the object's version tells."""
    local = write_local(tmp_path)
    url = upload(s3, s3_prefix, local)
    src = remote_source(s3, url, tmp_path / "c")
    monkeypatch.setattr(_ranges, "READ_AHEAD_BATCHES", 1)
    ds = evenly.Dataset(src, shuffle="global", seed=1)
    loader = evenly.DataLoader(ds, batch_size=4, collate_fn=as_list)
    batches = iter(loader)
    served = list(next(batches))
    new = write_local(tmp_path, fill=b"NEW", name="new")
    assert (new / "shard-00003.tar").stat().st_size == (local / "shard-00003.tar").stat().st_size
    shard = f"{url}/shard-00003.tar"
    s3.fs().put_file(str(new / "shard-00003.tar"), shard)
    with pytest.raises((ValueError, RuntimeError), match=re.escape(shard) + ".*changed"):
        for batch in batches:
            served.extend(batch)
    assert served and not [s for s in served if s["bin"].startswith(b"NEW")]
    assert cached_shards(tmp_path / "c") == []
    assert src._ranges is not None
    assert (src._ranges._store is not None) == (fetch_path == "obstore")


def test_a_shard_in_the_local_cache_is_read_from_there(
    s3: S3Endpoint, s3_prefix: str, tmp_path: Path
) -> None:
    """Shards left in the cache by a block-shuffle epoch are read from there; the
    others by range, never downloaded again."""
    local = write_local(tmp_path)
    url = upload(s3, s3_prefix, local)
    cache_dir = tmp_path / "c"
    src = es.from_webdataset(url, storage_options=s3.storage_options, cache_dir=str(cache_dir))
    block = evenly.Dataset(src, shuffle="block")
    assert len(ids(list(evenly.DataLoader(block, batch_size=8, collate_fn=as_list)))) == N
    held = cached_shards(cache_dir)
    assert len(held) == N // PER_SHARD  # the block shuffle downloaded every shard
    evicted = [n for n in held if re.search(r"shard-0000[0-3]", n)]
    for name in evicted:
        os.unlink(cache_dir / "shards" / name)
    src.close()  # no file of them open any more
    before = src.io_stats().get("bytes_fetched", 0)  # the block epoch's downloads
    assert sorted(order(src, seed=2)) == list(range(N))
    assert sorted(cached_shards(cache_dir)) == sorted(set(held) - set(evicted))
    their_bytes = sum((local / f"shard-0000{k}.tar").stat().st_size for k in range(4))
    assert 0 < src.io_stats()["bytes_fetched"] - before <= 1.2 * their_bytes


def test_a_filesystem_without_async_reads_by_range_on_threads(
    s3: S3Endpoint,
    s3_prefix: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    fetch_path: str,
) -> None:
    """The path for fsspec filesystems with no async implementation (a thread pool of
    synchronous ``cat_file`` range reads), taken here with s3fs's synchronous API (and
    obstore's synchronous ``get``, on the same threads)."""
    local = write_local(tmp_path)
    url = upload(s3, s3_prefix, local)
    made = _ranges.RangeReader.__init__

    def synchronous(self: _ranges.RangeReader, *args: Any, **kwargs: Any) -> None:
        made(self, *args, **kwargs)
        self._async = False

    monkeypatch.setattr(_ranges.RangeReader, "__init__", synchronous)
    cache_dir = tmp_path / "c"
    src = remote_source(s3, url, cache_dir)
    assert order(src, seed=4) == order(es.from_webdataset(str(local)), seed=4)
    assert src._ranges is not None and src._ranges._pool is not None  # the threads read
    assert (src._ranges._store is not None) == (fetch_path == "obstore")
    assert cached_shards(cache_dir) == [] and src.io_stats()["bytes_fetched"] > 0
