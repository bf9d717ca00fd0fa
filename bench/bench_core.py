"""Core benchmarks, side by side with the alternatives, printed as ratios.

1. Planning N = 10**9: reading the first, middle and last 10**6 positions of rank 3 of 8,
   RSS growth, next to what ``torch.randperm(N)`` needs (run in a child process).
2. Throughput: evenly.DataLoader vs a map-style DataLoader with RandomSampler over the
   same in-memory source (same batch size and workers).
3. Per-sample seeding: the same loader with an identity transform (seeding on) vs none.

    python bench/bench_core.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import psutil
import torch
import torch.utils.data as tud

import evenly


def rss_mb() -> float:
    return float(psutil.Process().memory_info().rss) / 2**20


def plan_billion() -> tuple[float, float]:
    n, world, rank, batch = 10**9, 8, 3, 256
    before = rss_mb()
    t0 = time.perf_counter()
    plan = evenly.EpochPlan(num_samples=n, world_size=world, batch_size=batch, shuffle=True)
    per_window = 10**6 // batch
    per_chunk = 32  # as the Dataset reads: 8192 positions per numpy call
    checksum = 0
    for first in (0, plan.num_batches // 2, plan.num_batches - per_window):
        for lo in range(first, first + per_window, per_chunk):
            batches = np.arange(lo, min(lo + per_chunk, first + per_window))
            idx = plan.indices(plan.batches_positions(rank, batches))
            checksum ^= int(idx.sum())
    return time.perf_counter() - t0, rss_mb() - before


def randperm_child(n: int) -> None:
    before = rss_mb()
    t0 = time.perf_counter()
    perm = torch.randperm(n)
    print(f"{time.perf_counter() - t0:.3f} {rss_mb() - before:.1f} {int(perm[0]) >= 0}")


def randperm(n: int) -> tuple[float, float]:
    out = subprocess.run(
        [sys.executable, __file__, "--randperm-child", str(n)],
        capture_output=True,
        text=True,
        check=True,
    )
    seconds, mb, _ = out.stdout.split()
    return float(seconds), float(mb)


def identity(x: Any) -> Any:
    return x


def samples_per_second(make: Callable[[], tud.DataLoader[Any]], epochs: int) -> float:
    loader = make()
    rates = []
    for _ in range(epochs):
        t0 = time.perf_counter()
        count = sum(len(batch) for batch in loader)
        rates.append(count / (time.perf_counter() - t0))
    return statistics.median(rates)


def throughput(n: int, workers: int, batch: int, epochs: int) -> dict[str, float]:
    source = [np.float32(i) for i in range(n)]
    persistent = workers > 0

    def map_style() -> tud.DataLoader[Any]:
        return tud.DataLoader(
            source,
            batch_size=batch,
            num_workers=workers,
            sampler=tud.RandomSampler(source),
            persistent_workers=persistent,
        )

    def ours(transform: Callable[[Any], Any] | None = None) -> Callable[[], tud.DataLoader[Any]]:
        def make() -> tud.DataLoader[Any]:
            ds = evenly.Dataset(source, shuffle=True, transform=transform)
            return evenly.DataLoader(
                ds, batch_size=batch, num_workers=workers, persistent_workers=persistent
            )

        return make

    return {
        "map-style RandomSampler": samples_per_second(map_style, epochs),
        "evenly": samples_per_second(ours(), epochs),
        "evenly + per-sample seeding": samples_per_second(ours(identity), epochs),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="smaller sizes, no randperm")
    parser.add_argument(
        "--randperm-n",
        type=float,
        default=1e8,
        help="N for torch.randperm (1e9 takes ~4 min and 7.6 GB on 2 cores)",
    )
    parser.add_argument("--randperm-child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.randperm_child:
        randperm_child(args.randperm_child)
        return
    print(f"# bench_core  torch {torch.__version__}  cpus {os.cpu_count()}")

    seconds, mb = plan_billion()
    print(f"plan N=1e9, rank 3/8, 3 x 1e6 positions: {seconds:.2f} s, RSS growth {mb:.1f} MB")
    if not args.quick:
        rn = int(args.randperm_n)
        r_seconds, r_mb = randperm(rn)
        print(f"torch.randperm({rn:.0e}): {r_seconds:.2f} s, RSS growth {r_mb:.1f} MB")
        scale = 10**9 / rn
        print(
            f"  randperm(1e9) needs ~{r_mb * scale:.0f} MB: {r_mb * scale / max(mb, 1.0):.0f}x "
            f"evenly's growth for the whole 1e9 plan"
        )

    n = 200_000 if args.quick else 1_000_000
    for workers in (0, 2):
        rates = throughput(n, workers, batch=256, epochs=3)
        base = rates["map-style RandomSampler"]
        print(f"\nthroughput, {n} in-memory samples, batch 256, {workers} workers (median of 3)")
        for name, rate in rates.items():
            print(f"  {name:<30} {rate:>12,.0f} samples/s   ratio {rate / base:.3f}")


if __name__ == "__main__":
    main()
