"""``loader.stats()``: per-epoch counts, where the time went, and the source's counters,
carried with the batches from real DataLoader workers."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

import evenly
import evenly.sources as es


class Counted:
    """A source that reports its reads (100 bytes per sample, 400 decoded, every third a
    cache hit) through ``io_stats()``, as a caching source does."""

    def __init__(self, n: int, read_sleep: float = 0.0) -> None:
        self.n = n
        self.read_sleep = read_sleep
        self.counters = {"bytes_read": 0, "bytes_decoded": 0, "cache_hits": 0, "cache_misses": 0}
        self.counters["decode_seconds"] = 0.0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if self.read_sleep:
            time.sleep(self.read_sleep)
        self.counters["bytes_read"] += 100
        self.counters["bytes_decoded"] += 400
        self.counters["cache_hits" if i % 3 == 0 else "cache_misses"] += 1
        return i

    def io_stats(self) -> dict[str, float]:
        return dict(self.counters)


@pytest.mark.parametrize("workers", [0, 2])
def test_each_epoch_counts_its_batches_samples_and_the_sources_counters(workers: int) -> None:
    """Past the batches whose figures are summed in one go (64) too."""
    loader = evenly.DataLoader(
        evenly.Dataset(Counted(300), shuffle=True), batch_size=4, num_workers=workers
    )
    for _ in range(2):
        assert sum(len(b) for b in loader) == 300
    first, second = loader.stats().epochs
    assert (first.epoch, second.epoch) == (0, 1)
    for e in (first, second):
        assert (e.batches, e.samples, e.finished) == (75, 300, True)
        assert (e.bytes_read, e.bytes_decoded) == (30000, 120000)
        assert (e.cache_hits, e.cache_misses) == (100, 200)
        assert e.cache_hit_rate == pytest.approx(1 / 3)
        assert 0 <= e.waited_seconds <= e.seconds and e.samples_per_second > 0


@pytest.mark.parametrize("workers", [0, 2])
def test_a_source_without_counters_reports_none_and_a_partial_epoch_what_was_received(
    workers: int,
) -> None:
    """Also past the batches whose figures are summed in one go (64), and with no
    workers (the stats read the main process's clock)."""
    loader = evenly.DataLoader(evenly.Dataset(list(range(400))), batch_size=5, num_workers=workers)
    it = iter(loader)
    for received in (3, 70):
        while loader.stats().last is None or loader.stats().last.batches < received:
            next(it)
        e = loader.stats().last
        assert e is not None
        assert (e.batches, e.samples, e.finished) == (received, 5 * received, False)
    assert (e.bytes_read, e.cache_hits, e.cache_hit_rate) == (None, None, None)
    assert evenly.DataLoader(evenly.Dataset([1]), batch_size=1).stats().last is None


def slow_transform(x: int) -> int:
    time.sleep(0.004)
    return x


class SlowDecode(Counted):
    """Reads that report most of their time as decoding."""

    def __getitem__(self, i: int) -> int:
        started = time.perf_counter()
        time.sleep(0.004)
        self.counters["decode_seconds"] += time.perf_counter() - started
        return super().__getitem__(i)


@pytest.mark.parametrize(
    ("source", "transform", "stage"),
    [
        (Counted(24, read_sleep=0.004), None, "read"),
        (SlowDecode(24), None, "decode"),
        (list(range(24)), slow_transform, "transform"),
    ],
)
def test_the_slow_stage_is_the_one_that_sleeps(source: Any, transform: Any, stage: str) -> None:
    ds = evenly.Dataset(source, transform=transform)
    loader = evenly.DataLoader(ds, batch_size=4, num_workers=2)
    list(loader)
    e = loader.stats().last
    assert e is not None and e.slowest_stage == stage
    assert e.stages[stage] > 24 * 0.004 * 0.9  # every sleep is counted, once
    assert e.waited_fraction > 0.3  # the loop did nothing: it waited for the workers


def test_stats_are_a_frozen_snapshot_and_a_table() -> None:
    loader = evenly.DataLoader(evenly.Dataset(list(range(8))), batch_size=4)
    list(loader)
    stats = loader.stats()
    with pytest.raises(AttributeError):
        stats.last.batches = 0  # type: ignore[misc, union-attr]
    list(loader)
    assert len(stats.epochs) == 1 and len(loader.stats().epochs) == 2
    assert loader.stats().table().splitlines()[0].split()[:3] == ["epoch", "batches", "samples/s"]


def test_the_file_sources_report_what_they_read_decode_and_find_in_their_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EVENLY_CACHE_DIR", str(tmp_path / "cache"))
    rows = [{"id": i, "text": "x" * 50} for i in range(60)]
    for fmt in ("parquet", "jsonl"):
        es.write(rows, tmp_path / fmt, format=fmt, rows_per_shard=20, row_group_size=10)
    lines = sum(p.stat().st_size for p in (tmp_path / "jsonl").glob("*.jsonl"))

    def epoch(source: Any, **kwargs: Any) -> evenly.EpochStats:
        loader = evenly.DataLoader(evenly.Dataset(source, shuffle=True), batch_size=8, **kwargs)
        assert sum(len(b["id"]) for b in loader) == 60
        e = loader.stats().last
        assert e is not None
        return e

    parquet = epoch(es.from_parquet(tmp_path / "parquet"))
    # 6 row groups, each decoded once; later batches find it in the row-group cache
    assert parquet.cache_misses == 6
    assert parquet.cache_hits is not None and parquet.cache_hits > 0
    assert parquet.bytes_decoded is not None and parquet.bytes_decoded > 0
    assert parquet.decode_seconds > 0 and parquet.bytes_read is None
    # a cold node cache for the columnar pass (the first pass filled the other one)
    monkeypatch.setenv("EVENLY_CACHE_DIR", str(tmp_path / "cache2"))
    columns = epoch(es.from_parquet(tmp_path / "parquet"), columnar=True)
    assert (columns.batches, columns.samples, columns.cache_misses) == (8, 60, 6)
    jsonl = epoch(es.from_jsonl(tmp_path / "jsonl"))
    assert jsonl.bytes_read is not None and lines <= jsonl.bytes_read <= lines + 2 * 60
    assert (jsonl.cache_hits, jsonl.bytes_decoded) == (None, None)


def test_an_endless_pass_is_one_entry_counting_what_the_loop_took() -> None:
    loader = evenly.DataLoader(evenly.Dataset(list(range(10))), batch_size=4, infinite=True)
    it = iter(loader)
    for _ in range(6):  # 24 samples: across two epoch boundaries
        next(it)
    (e,) = loader.stats().epochs
    assert (e.epoch, e.batches, e.samples, e.finished) == (0, 6, 24, False)
