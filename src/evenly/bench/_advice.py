"""What ``evenly bench`` advises, from its measurements (a pure function of them).

>>> rows = [Row("processes", 0, 1000.0, 0.99, {"read": 0.9, "transform": 0.0}),
...         Row("processes", 2, 1900.0, 0.98, {"read": 0.9, "transform": 0.0})]
>>> [a.code for a in advise(rows, Facts(source="list", shuffle="global", seeded=False))]
['more-workers']
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["Advice", "Facts", "Row", "advise"]

#: a configuration is worth it when it is this much faster than the next best
GAIN = 1.2
#: the loop waited for data this share of the time or more: the loader is the bottleneck
DATA_BOUND = 0.5
#: waiting for downloads takes this share of the workers' time or more: the link limits
FETCH_BOUND = 0.5


@dataclass(frozen=True)
class Row:
    """One configuration's measurement."""

    mode: str  # "processes" (DataLoader workers); see evenly.bench._run.MODES
    workers: int
    samples_per_second: float
    waited_fraction: float
    #: seconds per batch in each stage, summed over workers
    stages: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Facts:
    """What is known about the dataset besides the timings."""

    source: str  # the source's class name
    shuffle: str  # "none", "global", "block"
    seeded: bool  # a transform runs with the default three generators seeded per sample
    columnar: bool = False  # batches read column by column already
    sharded: bool = False  # files in shards (block shuffle possible)


@dataclass(frozen=True)
class Advice:
    code: str
    text: str


def advise(rows: Sequence[Row], facts: Facts) -> list[Advice]:
    """The advice for these measurements, most important first."""
    out: list[Advice] = []
    best = max(rows, key=lambda r: r.samples_per_second)
    by_workers = sorted((r for r in rows if r.mode == best.mode), key=lambda r: r.workers)
    most = by_workers[-1]
    if best is most and len(by_workers) > 1:
        previous = by_workers[-2]
        if best.samples_per_second >= GAIN * previous.samples_per_second:
            out.append(
                Advice(
                    "more-workers",
                    f"more workers: throughput still grows at {most.workers} workers "
                    f"({previous.samples_per_second:,.0f} -> {best.samples_per_second:,.0f} "
                    f"samples/s from {previous.workers}); try num_workers={2 * most.workers}",
                )
            )
    zero = next((r for r in by_workers if r.workers == 0), None)
    if zero is not None and best.samples_per_second < GAIN * zero.samples_per_second:
        out.append(
            Advice(
                "no-workers",
                f"workers do not pay here: the per-batch work is small next to handing "
                f"batches between processes ({zero.samples_per_second:,.0f} samples/s with "
                f"0 workers, {best.samples_per_second:,.0f} at best); use num_workers=0, or "
                f"threads where the loader offers them",
            )
        )
    stages = best.stages
    total = sum(stages.values()) or 1.0
    fetching = stages.get("fetch", 0.0) / total
    if best.waited_fraction >= DATA_BOUND and fetching >= FETCH_BOUND:
        out.append(
            Advice(
                "fetch-bound",
                f"waiting for downloads takes {fetching:.0%} of the workers' time: the link "
                f"to the storage is the limit; keep more requests in flight (max_in_flight, "
                f"node-wide) and give the shard cache room for at least two windows of the "
                f"block shuffle (cache_bytes), so nothing is fetched twice; see "
                f"docs/formats.md, Remote storage",
            )
        )
    reading = (stages.get("read", 0.0) + stages.get("decode", 0.0)) / total
    if best.waited_fraction >= DATA_BOUND and reading >= 0.5:
        if facts.source in ("ParquetSource", "JsonlSource"):
            out.append(
                Advice(
                    "arrow",
                    f"reading and decoding take {reading:.0%} of the workers' time: Arrow "
                    f"files are memory-mapped with no decode (evenly write ... --format "
                    f"arrow) instead of {facts.source.replace('Source', '')}",
                )
            )
        if facts.sharded and facts.shuffle == "global":
            out.append(
                Advice(
                    "block-shuffle",
                    "a global shuffle over shards reads rows from everywhere: "
                    "shuffle='block' reads a few shards at a time (see docs/formats.md)",
                )
            )
        if not facts.columnar and facts.source in ("ArrowSource", "ParquetSource"):
            out.append(
                Advice(
                    "columnar",
                    "no per-sample work: columnar=True reads whole batches column by column",
                )
            )
    if facts.seeded and stages.get("transform", 0.0) / total >= 0.3:
        out.append(
            Advice(
                "seed-generators",
                "the transform takes much of the time and seeds random, numpy and torch "
                "per sample: name only the generators it draws from (seed_generators=...)",
            )
        )
    return out
