"""Mixture planning speed and memory: positions/s of ``MixOrder`` with 100 sources.

Goal (issue 12): >= 1 M positions/s with 100 sources, O(number of sources) memory.
Rows: the positions one rank reads (rank 3 of 8, batch 256, 32 batches per numpy call,
as the Dataset reads them), and contiguous chunks of 8192 positions at several global
step sizes ``G``; then the same rank through ``evenly.Dataset(evenly.Mix(...)).plan_for``
(the plan a DataLoader worker builds: its worker's chunks, positions -> indices), and the
cost of ``plan_for`` itself (once per pass and worker).  Memory: tracemalloc's peak over
the run (numpy allocations included), and the process RSS growth.

    python bench/bench_mix.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import time
import tracemalloc
from collections.abc import Callable, Iterator

import numpy as np
import psutil

from evenly.core.mix.apportion import epoch_offsets, mix_counts
from evenly.core.mix.order import MixOrder
from evenly.core.spec import PassSpec
from evenly.dataset import Dataset, planner_of
from evenly.mixture import Mix

SOURCES = 100
Chunks = Iterator[np.ndarray]
EPOCH = 10**9  # samples per epoch: nothing of this size is ever allocated


def make_order(step: int) -> MixOrder:
    rng = np.random.default_rng(0)
    lengths = rng.integers(1_000, 50_000_000, SOURCES).tolist()
    weights = rng.pareto(1.0, SOURCES).tolist()  # a long tail of small sources
    counts = mix_counts(lengths, weights, EPOCH)
    return MixOrder(
        lengths,
        counts,
        epoch_offsets(counts, 7),
        names=[f"source-{d}" for d in range(SOURCES)],
        seed=0,
        epoch=7,
        shuffle=True,
        step=step,
    )


def make_dataset() -> Dataset[int]:
    rng = np.random.default_rng(0)
    lengths = rng.integers(1_000, 50_000_000, SOURCES).tolist()
    weights = rng.pareto(1.0, SOURCES).tolist()
    mix = Mix(
        {f"source-{d}": range(n) for d, n in enumerate(lengths)},
        weights={f"source-{d}": w for d, w in enumerate(weights)},
        samples_per_epoch=EPOCH,
    )
    return Dataset(mix, shuffle=True, seed=0)


def through_dataset(total: int) -> tuple[float, float]:
    """(positions/s of one worker's share via plan.indices, seconds per plan_for)."""
    ds = make_dataset()
    spec = PassSpec(epoch=7, start=0, num_samples=EPOCH, batch_size=256, rank=3, world_size=8)
    t0 = time.perf_counter()
    for _ in range(100):
        plan = planner_of(ds).plan_for(spec)
    per_plan = (time.perf_counter() - t0) / 100
    done, seconds = 0, 0.0
    first = EPOCH // 2 // (8 * 256)  # from the middle of the epoch, 32 batches per chunk
    for positions, _ in plan.iter_worker_chunks(3, 1, 0, chunk=32 * 256, first=first):
        t0 = time.perf_counter()
        plan.indices(positions)
        seconds += time.perf_counter() - t0
        done += positions.size
        if done >= total:
            break
    return done / seconds, per_plan


def rank_chunks(total: int, world: int = 8, rank: int = 3, batch: int = 256) -> Chunks:
    step = world * batch
    first = EPOCH // 2 // step
    for lo in range(first, first + total // batch, 32):
        steps = np.arange(lo, lo + 32, dtype=np.int64) * step + rank * batch
        yield (steps[:, None] + np.arange(batch)).ravel()


def contiguous_chunks(total: int) -> Chunks:
    for p in range(EPOCH // 3, EPOCH // 3 + total, 8192):
        yield np.arange(p, p + 8192)


def measure(order: MixOrder, chunks: Chunks) -> float:
    done, seconds = 0, 0.0
    for chunk in chunks:
        t0 = time.perf_counter()
        order(chunk)
        seconds += time.perf_counter() - t0
        done += chunk.size
    return done / seconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer positions per row")
    args = parser.parse_args()
    total = 500_000 if args.quick else 4_000_000
    print(f"# bench_mix  {SOURCES} sources, epoch {EPOCH:.0e}  cpus {os.cpu_count()}")
    rows: list[tuple[str, int, Callable[[int], Chunks]]] = [
        ("rank 3 of 8, batch 256 (G=2048)", 2048, rank_chunks)
    ]
    for g in (2, 256, 4096):
        rows.append((f"contiguous 8192, G={g}", g, contiguous_chunks))
    for label, step, chunks in rows:
        order = make_order(step)
        minors = sum(b > 1 for b in order.bounds)
        rate = measure(order, chunks(total))
        print(f"{label:34s} {rate / 1e6:6.2f} M positions/s   sources with bound > 1: {minors}")
    rate, per_plan = through_dataset(total)
    print(
        f"{'Dataset(Mix).plan_for, rank 3 of 8':34s} {rate / 1e6:6.2f} M positions/s   "
        f"plan_for: {per_plan * 1e3:.2f} ms per pass and worker"
    )
    # memory: a fresh order, then 200 chunks of the rank's positions under tracemalloc
    proc = psutil.Process()
    rss0 = proc.memory_info().rss
    tracemalloc.start()
    order = make_order(2048)
    measure(order, rank_chunks(200 * 8192))
    size, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    rss = (proc.memory_info().rss - rss0) / 2**20
    print(
        f"memory: order + 200 calls: tracemalloc peak {peak / 2**20:.1f} MB "
        f"(held after: {size / 2**10:.0f} KB), RSS +{rss:.1f} MB"
    )


if __name__ == "__main__":
    main()
