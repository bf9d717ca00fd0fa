"""Core benchmarks, side by side with the alternatives, printed as ratios.

1. Planning N = 10**9: reading the first, middle and last 10**6 positions of rank 3 of 8,
   RSS growth, next to what ``torch.randperm(N)`` needs (run in a child process).
2. Per-sample seeding cost (microseconds per sample, one process) for the default three
   generators, for ``seed_generators=("torch",)`` and for ``()``.
3. Throughput: evenly.DataLoader vs a map-style DataLoader with RandomSampler over the
   same in-memory source (same batch size and workers), 0 and 2 workers, and evenly with
   an identity transform under each ``seed_generators`` setting; the loaders are built
   once, warmed up one epoch, then run one epoch each per round, interleaved.

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
from evenly.runtime.seeds import GENERATORS


def rss_mb() -> float:
    return float(psutil.Process().memory_info().rss) / 2**20


def plan_billion() -> tuple[float, float]:
    n, world, rank, batch = 10**9, 8, 3, 256
    before = rss_mb()
    t0 = time.perf_counter()
    order = evenly.core.FeistelPermutation(n, seed=0, epoch=0)
    plan = evenly.core.EpochPlan(num_samples=n, world_size=world, batch_size=batch, order=order)
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


def seeding_cost(generators: tuple[str, ...], n: int = 200_000) -> float:
    """Microseconds per sample to seed ``generators`` (evenly's per-sample seeding, as the
    reader does it: spread a batch's seeds at once, then seed before each sample)."""
    from evenly.runtime.seeds import RngState, SeedSpreader

    plan = evenly.core.EpochPlan(num_samples=n, batch_size=256)
    spreader = SeedSpreader(generators)
    t0 = time.perf_counter()
    for lo in range(0, n, 256):
        positions = np.arange(lo, min(lo + 256, n))
        saved = RngState(generators)
        spreader.prepare(plan.seeds(positions))
        for i in range(positions.size):
            spreader.seed(i)
        saved.restore()
    return (time.perf_counter() - t0) / n * 1e6


def throughput(n: int, workers: int, batch: int, rounds: int) -> dict[str, list[float]]:
    """samples/s of each loader, one epoch per round, the loaders interleaved."""
    source = [np.float32(i) for i in range(n)]
    persistent = workers > 0

    def ours(
        transform: Callable[[Any], Any] | None = None, generators: tuple[str, ...] = GENERATORS
    ) -> tud.DataLoader[Any]:
        ds = evenly.Dataset(source, shuffle=True, transform=transform, seed_generators=generators)
        return evenly.DataLoader(
            ds, batch_size=batch, num_workers=workers, persistent_workers=persistent
        )

    loaders: dict[str, tud.DataLoader[Any]] = {
        "map-style RandomSampler": tud.DataLoader(
            source,  # type: ignore[arg-type]
            batch_size=batch,
            num_workers=workers,
            sampler=tud.RandomSampler(source),
            persistent_workers=persistent,
        ),
        "evenly": ours(),
        "evenly + transform, 3 generators": ours(identity),
        "evenly + transform, ('torch',)": ours(identity, ("torch",)),
        "evenly + transform, ()": ours(identity, ()),
    }
    for loader in loaders.values():  # warm-up: workers started, caches filled
        sum(len(b) for b in loader)
    rates: dict[str, list[float]] = {name: [] for name in loaders}
    for r in range(rounds):
        names = list(loaders)
        names = names[r % len(names) :] + names[: r % len(names)]
        for name in names:
            t0 = time.perf_counter()
            count = sum(len(b) for b in loaders[name])
            rates[name].append(count / (time.perf_counter() - t0))
    return rates


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

    print("\nper-sample seeding, one process (us per sample)")
    for gens in (GENERATORS, ("torch",), ()):
        print(f"  seed_generators={gens!s:<30} {seeding_cost(gens):6.2f} us")

    n = 200_000 if args.quick else 1_000_000
    rounds = 3 if args.quick else 5
    for workers in (0, 2):
        rates = throughput(n, workers, batch=256, rounds=rounds)
        base = statistics.median(rates["map-style RandomSampler"])
        plain = statistics.median(rates["evenly"])
        print(
            f"\nthroughput, {n:,} in-memory samples, batch 256, {workers} workers, epoch 2 on, "
            f"{rounds} interleaved rounds: median [min-max]"
        )
        for name, values in rates.items():
            med = statistics.median(values)
            cost = ""
            if "transform" in name:  # worker CPU per sample over the plain loader
                us = (1 / med - 1 / plain) * max(workers, 1) * 1e6
                cost = f"   +{us:5.2f} us/sample"
            print(
                f"  {name:<34} {med:>10,.0f} [{min(values):,.0f}-{max(values):,.0f}] samples/s"
                f"   ratio {med / base:.3f}{cost}"
            )


if __name__ == "__main__":
    main()
