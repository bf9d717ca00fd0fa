"""The node-local decoded-row cache: one decoded copy of each Parquet row group per node,
shared by every rank and worker, bounded, safe under concurrent and killed writers, never
stale, and refused (with a warning) on a network file system."""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import random
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import evenly
import evenly.sources._cachedir as cachedir
import evenly.sources._rowcache as rowcache
from evenly.errors import EvenlyWarning
from evenly.sources._cachedir import PART
from evenly.sources._rowcache import RowCache
from tests import s3server
from tests.distributed import run_ranks
from tests.s3server import S3Endpoint

s3 = s3server.s3  # a real moto server and a fresh key prefix per test
s3_prefix = s3server.s3_prefix

N, SHARDS, GROUP = 800, 8, 25  # 32 row groups
BATCH = 8


def payload(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest() * 8  # 256 bytes, one per id


def random_payload(i: int) -> bytes:
    return random.Random(i).randbytes(256)  # incompressible


def write_shards(out: Path, n: int = N, payloads: Callable[[int], bytes] = payload) -> None:
    """``n`` rows in shards of ``N // SHARDS`` rows, row groups of ``GROUP``."""
    rows = [{"id": i, "payload": payloads(i), "tag": str(i)} for i in range(n)]
    evenly.write(rows, out, rows_per_shard=N // SHARDS, row_group_size=GROUP, progress=False)


def entries(cache_dir: Path) -> list[str]:
    return sorted(n for n in os.listdir(cache_dir / "rows") if n.endswith(".arrow"))


def parts(cache_dir: Path) -> list[str]:
    return sorted(n for n in os.listdir(cache_dir / "rows") if PART in n)


def check_rows(rows: list[dict[str, Any]], payloads: Callable[[int], bytes] = payload) -> None:
    for r in rows:
        assert r["payload"] == payloads(r["id"]) and r["tag"] == str(r["id"]), r["id"]


# ---- 4 ranks x 2 workers sharing one small cache ----------------------------------------
def _rank_reads(rank: int, world: int, data: str, cache: str, bound: int) -> list[list[int]]:
    src = evenly.from_parquet(data, cache_dir=cache, decoded_cache_bytes=bound)
    ds = evenly.Dataset(src, shuffle=True, seed=3)
    loader = evenly.DataLoader(ds, batch_size=BATCH, num_workers=2)
    epochs = []
    for epoch in range(2):
        loader.set_epoch(epoch)
        got: list[int] = []
        for batch in loader:
            ids = batch["id"].tolist()
            for i, p, t in zip(ids, batch["payload"], batch["tag"], strict=True):
                assert p == payload(i) and t == str(i), f"rank {rank}: sample {i} is corrupt"
            got.extend(ids)
        epochs.append(got)
    return epochs


def test_four_ranks_of_two_workers_share_one_small_cache(tmp_path: Path) -> None:
    """Every row group is decoded into one cache that holds about a third of them: the
    eight workers evict each other's entries while others have them mapped; each epoch is
    still exactly once over the ranks, every sample intact, and the bound held."""
    write_shards(tmp_path / "d")
    cache = tmp_path / "c"
    one = evenly.from_parquet(tmp_path / "d", cache_dir=str(cache))
    one.__getitems__(list(range(GROUP)))  # one row group: the size of an entry
    entry = os.path.getsize(cache / "rows" / entries(cache)[0])
    bound = entry * 32 // 3
    os.unlink(cache / "rows" / entries(cache)[0])
    os.unlink(cache / "rows" / ".usage")
    env = {"PYTHONWARNINGS": "ignore"}
    results = run_ranks(_rank_reads, 4, str(tmp_path / "d"), str(cache), bound, env=env)
    for epoch in range(2):
        ids = sorted(i for rank in results for i in rank[epoch])
        assert ids == list(range(N)), f"epoch {epoch} is not exactly once"
    assert RowCache(str(cache), bound).usage() <= bound
    assert parts(cache) == []
    left = entries(cache)
    assert 0 < len(left) < 32  # used, and evicted
    for name in left:  # what is left is whole: every entry maps and holds its rows
        table = rowcache._map(str(cache / "rows" / name))
        check_rows(table.to_pylist())


# ---- decoded once per node; a changed file decoded again --------------------------------
def test_a_row_group_is_decoded_once_per_node_and_again_when_its_file_changes(
    tmp_path: Path,
) -> None:
    write_shards(tmp_path / "d", n=100)
    cache = str(tmp_path / "c")
    first = evenly.from_parquet(tmp_path / "d", cache_dir=cache)
    check_rows(first.__getitems__(list(range(100))))
    assert first.decoded_cache is not None
    assert first.decoded_cache.stats() == {"hits": 0, "misses": 4, "decodes": 4}
    again = evenly.from_parquet(tmp_path / "d", cache_dir=cache)  # another process, say
    check_rows(again.__getitems__(list(range(100))))
    assert again.decoded_cache is not None
    assert again.decoded_cache.stats() == {"hits": 4, "misses": 0, "decodes": 0}
    # the shard is rewritten with other values (same rows, same row groups)
    shard = sorted((tmp_path / "d").glob("*.parquet"))[0]
    table = pq.read_table(shard)
    tags = pa.array([f"new{i}" for i in table["id"].to_pylist()])
    time.sleep(0.01)
    pq.write_table(table.set_column(2, "tag", tags), shard, row_group_size=GROUP)
    stale = first.__getitems__([0])  # the process's own copy: the file it opened
    assert stale[0]["tag"] == "0"
    with pytest.raises(ValueError, match="changed since the source was opened"):
        first.check_unchanged()  # at the next pass start
    fresh = evenly.from_parquet(tmp_path / "d", cache_dir=cache)
    rows = fresh.__getitems__(list(range(100)))
    assert [r["tag"] for r in rows[:GROUP]] == [f"new{i}" for i in range(GROUP)]
    assert fresh.decoded_cache is not None and fresh.decoded_cache.decodes == 4


def test_a_source_opened_before_a_change_never_caches_the_new_bytes(tmp_path: Path) -> None:
    write_shards(tmp_path / "d", n=100)
    cache = str(tmp_path / "c")
    src = evenly.from_parquet(tmp_path / "d", cache_dir=cache)
    shard = sorted((tmp_path / "d").glob("*.parquet"))[0]
    table = pq.read_table(shard)
    time.sleep(0.01)
    tags = pa.array(["x"] * table.num_rows)
    pq.write_table(table.set_column(2, "tag", tags), shard, row_group_size=GROUP)
    with pytest.raises(ValueError, match="changed since it was opened"):
        src.__getitems__([0])
    assert entries(tmp_path / "c") == []


def test_a_remote_shard_is_kept_once_decoded_in_the_shard_cache_within_cache_bytes(
    s3: S3Endpoint, s3_prefix: str, tmp_path: Path
) -> None:
    """One copy on disk for remote data: each row group decoded once into the shard
    cache, beside the downloaded shard until every row group of it is decoded, then the
    shard dropped (an empty marker left, so it is not fetched again); another process
    maps the rows: no download, no decode.  Before: the row groups were decoded in each
    process (none kept on disk), the shard kept as downloaded."""
    write_shards(tmp_path / "local", n=100, payloads=random_payload)  # incompressible
    url = s3.upload(str(tmp_path / "local"), f"{s3_prefix}/pq")
    cache = tmp_path / "c"
    first = evenly.from_parquet(url, storage_options=s3.storage_options, cache_dir=str(cache))
    assert first.cache is not None and first.decoded_cache is not None
    shard = (tmp_path / "local" / "shard-00000.parquet").stat().st_size
    check_rows(first.__getitems__(list(range(50))), random_payload)  # row groups 0, 1 of 4
    (raw,) = [p for p in (cache / "shards").iterdir() if p.name.endswith(".parquet")]
    assert raw.stat().st_size == shard  # kept: rows of it are not decoded yet
    check_rows(first.__getitems__(list(range(50, 100))), random_payload)
    assert first.cache.downloads == 1 and first.decoded_cache.decodes == 4
    decoded = sorted(p for p in (cache / "shards").iterdir() if p.name.endswith(".arrow"))
    assert len(decoded) == 4 and all(p.name.startswith(raw.name + "@rg") for p in decoded)
    assert raw.stat().st_size == 0  # dropped: the decoded copy is the one copy
    assert first.cache.usage() == sum(p.stat().st_size for p in decoded)
    assert not (cache / "rows").exists()  # nothing outside the shard cache's bound
    # another process on the node maps the decoded rows: no download, no decode
    again = evenly.from_parquet(url, storage_options=s3.storage_options, cache_dir=str(cache))
    check_rows(again.__getitems__(list(range(100))), random_payload)
    assert again.cache is not None and again.cache.downloads == 0
    assert again.decoded_cache is not None
    assert again.decoded_cache.stats() == {"hits": 4, "misses": 0, "decodes": 0}
    # an entry gone (evicted or damaged): its shard is fetched again, the row group decoded
    decoded[2].unlink()
    fresh = evenly.from_parquet(url, storage_options=s3.storage_options, cache_dir=str(cache))
    check_rows(fresh.__getitems__(list(range(100))), random_payload)
    assert fresh.cache is not None and fresh.cache.downloads == 1
    assert fresh.decoded_cache is not None and fresh.decoded_cache.decodes == 1
    assert raw.stat().st_size == 0  # and dropped again


@pytest.mark.parametrize("why", ["decoded_cache_bytes=0", "compressed data"])
def test_a_remote_shard_is_kept_as_downloaded_when_its_rows_are_not_kept_decoded(
    s3: S3Endpoint, s3_prefix: str, tmp_path: Path, why: str
) -> None:
    """The shard as downloaded stays the one copy, each process decoding what it reads:
    with ``decoded_cache_bytes=0``, or where its decoded rows would take more room than
    the shard (compressed columns: the footer's uncompressed bytes past 1.05x)."""
    off = why == "decoded_cache_bytes=0"
    write_shards(tmp_path / "local", n=100, payloads=random_payload if off else payload)
    url = s3.upload(str(tmp_path / "local"), f"{s3_prefix}/pq")
    src = evenly.from_parquet(
        url,
        storage_options=s3.storage_options,
        cache_dir=str(tmp_path / "c"),
        decoded_cache_bytes=0 if off else None,
    )
    check_rows(src.__getitems__(list(range(100))), random_payload if off else payload)
    assert src.cache is not None and (src.decoded_cache is None) == off
    if src.decoded_cache is not None:  # asked once, then the shard is read directly
        assert src.decoded_cache.stats() == {"hits": 0, "misses": 1, "decodes": 0}
    shard = (tmp_path / "local" / "shard-00000.parquet").stat().st_size
    assert src.cache.usage() == shard  # the download, nothing decoded on disk


def _evicting(cache_dir: str, ready: str, stop: str) -> None:
    """Another process of the node: the sweep for abandoned parts that every download's
    eviction runs first, over and over until ``stop`` exists."""
    from evenly.sources._cache import ShardCache

    cache = ShardCache(cache_dir, 1 << 40)
    Path(ready).touch()
    while not os.path.exists(stop):
        cache.remove_abandoned()


def test_a_shard_retired_while_another_process_evicts_is_retired(tmp_path: Path) -> None:
    """A shard whose rows are all decoded is retired (its copy replaced by an empty
    marker) while another process's eviction sweeps the cache for abandoned ``.part-``
    files: every retire lands, one copy per shard, no part left.  Before: the marker
    was written as a part file with the shard's lock free, which the sweep took for
    abandoned and removed before its rename: the shard stayed whole (1 in 5 epochs of
    test_remote_rowcache's two workers under load)."""
    from evenly.sources._cache import ShardCache

    cache_dir, ready, stop = str(tmp_path / "c"), tmp_path / "ready", tmp_path / "stop"
    cache = ShardCache(cache_dir, 1 << 40)
    urls = [f"s3://bucket/shard-{i:05d}.parquet" for i in range(400)]
    os.makedirs(cache.cache_dir, exist_ok=True)
    for url in urls:
        Path(cache.path_for(url, "fp")).write_bytes(b"x" * 100)
    sweeper = multiprocessing.get_context("spawn").Process(
        target=_evicting, args=(cache_dir, str(ready), str(stop))
    )
    sweeper.start()
    try:
        while not ready.exists():
            assert sweeper.is_alive() or sweeper.exitcode == 0, sweeper.exitcode
            time.sleep(0.01)
        retired = [cache.retire(url, "fp", 100) for url in urls]
    finally:
        stop.touch()
        sweeper.join(60)
    assert sweeper.exitcode == 0
    assert retired.count(False) == 0, retired.count(False)
    assert all(os.path.getsize(cache.path_for(url, "fp")) == 0 for url in urls)
    assert not [n for n in os.listdir(cache.cache_dir) if PART in n]


# ---- killed writers, damaged entries ----------------------------------------------------
KEY = ("/data/a.parquet", "10:1:2:3", 0, None)


def _stuck_writer(cache: str, ready: str) -> None:
    def half(tmp: str, table: pa.Table, key: Any) -> None:
        with open(tmp, "wb") as f:
            f.write(b"ARROW1\x00\x00" + b"\x00" * 100)  # a file cut short mid-write
        Path(ready).touch()
        time.sleep(120)

    rowcache._write = half  # type: ignore[assignment]
    RowCache(cache, 1 << 20).get(KEY, 3, lambda: pa.table({"x": [1, 2, 3]}))


def test_a_writer_killed_mid_write_leaves_nothing_a_reader_uses(tmp_path: Path) -> None:
    cache = str(tmp_path / "c")
    ready = tmp_path / "ready"
    proc = multiprocessing.get_context("fork").Process(
        target=_stuck_writer, args=(cache, str(ready))
    )
    proc.start()
    deadline = time.monotonic() + 60
    while not ready.exists() and proc.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert ready.exists(), "the writer never started writing"
    os.kill(proc.pid, signal.SIGKILL)  # mid-write, holding the entry's lock
    proc.join()
    assert entries(tmp_path / "c") == [] and len(parts(tmp_path / "c")) == 1
    reader = RowCache(cache, 1 << 20)
    table = reader.get(KEY, 3, lambda: pa.table({"x": [7, 8, 9]}))
    assert table["x"].to_pylist() == [7, 8, 9] and reader.decodes == 1  # decoded, not read
    assert parts(tmp_path / "c") == []  # the dead writer's file removed
    assert RowCache(cache, 1 << 20).get(KEY, 3, pa.table).num_rows == 3  # served now


def test_a_damaged_entry_is_decoded_again(tmp_path: Path) -> None:
    cache = RowCache(str(tmp_path / "c"), 1 << 20)
    cache.get(KEY, 3, lambda: pa.table({"x": [1, 2, 3]}))
    path = cache.path_for(KEY)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    other = RowCache(str(tmp_path / "c"), 1 << 20)
    with pytest.warns(EvenlyWarning, match="is damaged"):
        table = other.get(KEY, 3, lambda: pa.table({"x": [1, 2, 3]}))
    assert table["x"].to_pylist() == [1, 2, 3] and other.decodes == 1
    # an entry holding another chunk (a foreign or renamed file) is not trusted either
    other_key = (*KEY[:2], 1, None)
    os.replace(path, cache.path_for(other_key))
    with pytest.warns(EvenlyWarning, match="records another chunk"):
        found = other.get(other_key, 3, lambda: pa.table({"x": [4, 5, 6]}))
    assert found["x"].to_pylist() == [4, 5, 6]


def test_the_bound_evicts_least_recently_used_entries(tmp_path: Path) -> None:
    def key(g: int) -> tuple[str, str, int, None]:
        return ("/d/a.parquet", "1:2:3:4", g, None)

    probe = RowCache(str(tmp_path / "probe"), 1 << 30)
    probe.get(key(0), 1000, lambda: pa.table({"x": list(range(1000))}))
    size = probe.usage()
    cache = RowCache(str(tmp_path / "c"), size * 3)
    for g in range(3):
        cache.get(key(g), 1000, lambda: pa.table({"x": list(range(1000))}))
        os.utime(cache.path_for(key(g)), (1000 + g, 1000 + g))  # distinct recencies
    os.utime(cache.path_for(key(0)), (2000, 2000))  # entry 0 used last
    cache.get(key(3), 1000, lambda: pa.table({"x": list(range(1000))}))
    assert cache.usage() <= size * 3
    kept = {g for g in range(4) if os.path.exists(cache.path_for(key(g)))}
    assert kept == {0, 3}  # down to 90% of the bound: 1 and 2 (least recent) went


# ---- network file systems --------------------------------------------------------------
def test_a_cache_dir_on_a_network_file_system_is_warned_about(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_shards(tmp_path / "d", n=100)
    mounts = tmp_path / "mounts"
    mounts.write_text(f"/dev/sda1 / ext4 rw 0 0\nsrv:/export {tmp_path / 'nfs'} nfs4 rw 0 0\n")
    monkeypatch.setattr(cachedir, "MOUNTS", str(mounts))
    with pytest.warns(EvenlyWarning, match=r"network file system \(nfs4\).*it is off"):
        src = evenly.from_parquet(tmp_path / "d", cache_dir=str(tmp_path / "nfs" / "c"))
    assert src.decoded_cache is None
    check_rows(src.__getitems__([0, 99]))
    with pytest.warns(EvenlyWarning, match="it is used, as decoded_cache_bytes asks"):
        asked = evenly.from_parquet(
            tmp_path / "d", cache_dir=str(tmp_path / "nfs" / "c"), decoded_cache_bytes=1 << 20
        )
    assert asked.decoded_cache is not None
    local = evenly.from_parquet(tmp_path / "d", cache_dir=str(tmp_path / "local"))  # no warning
    assert local.decoded_cache is not None


def test_the_bound_setting_is_checked(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("EVENLY_DECODED_CACHE_BYTES", "lots")
    with pytest.raises(ValueError, match="EVENLY_DECODED_CACHE_BYTES='lots'"):
        rowcache.decoded_cache_bytes(None)
    monkeypatch.setenv("EVENLY_DECODED_CACHE_BYTES", "0")
    write_shards(tmp_path / "d", n=100)
    assert evenly.from_parquet(tmp_path / "d", cache_dir=str(tmp_path)).decoded_cache is None
    with pytest.raises(ValueError, match="decoded_cache_bytes must be >= 0"):
        evenly.from_parquet(tmp_path / "d", decoded_cache_bytes=-1)
