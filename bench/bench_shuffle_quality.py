"""Shuffle quality and storage traffic: global shuffle vs block(K) on 64 shards.

For each mode, over one epoch of the order the planning core produces (1 rank, 2
workers, batch 256, the worker split of evenly.DataLoader):

- spearman: rank correlation of position vs sample index (0 is ideal);
- same-shard rate: how often two consecutive samples come from one shard, vs the
  1/num_shards of a perfect shuffle;
- displacement: mean |index - position| / N (1/3 for a uniform shuffle);
- bytes read: shard bytes downloaded per epoch, as a multiple of the dataset, with an
  LRU cache of ``--cache-shards`` shards either per worker or per machine (evenly's
  shard cache is per machine: workers share it).

Order statistics are averaged over ``--epochs`` epochs (the shard order of the block
shuffle changes each epoch; one epoch's Spearman over 64 shards is noisy).

    python bench/bench_shuffle_quality.py                 # N=200,000, 64 shards, K=1,2,4,8,16
    python bench/bench_shuffle_quality.py --samples 1000000 --cache-shards 16
"""

from __future__ import annotations

import argparse
from collections import OrderedDict

import numpy as np

from evenly.core import EpochPlan
from evenly.core.order import make_order


def spearman(order: np.ndarray) -> float:
    pos = np.arange(order.size, dtype=np.float64)
    return float(np.corrcoef(pos, order.astype(np.float64))[0, 1])  # both are ranks


def shard_downloads(shards: np.ndarray, capacity: int) -> int:
    """Misses of an LRU cache of ``capacity`` shards over the shard sequence."""
    cache: OrderedDict[int, None] = OrderedDict()
    misses = 0
    for s in shards.tolist():
        if s in cache:
            cache.move_to_end(s)
            continue
        misses += 1
        cache[s] = None
        if len(cache) > capacity:
            cache.popitem(last=False)
    return misses


def measure(plan: EpochPlan, starts: np.ndarray, workers: int, capacity: int) -> dict[str, float]:
    n = plan.num_samples
    order = plan.indices(np.arange(n))
    shard = np.searchsorted(starts, order, side="right") - 1
    shard_bytes = np.diff(starts)
    machine = 0
    cache0: OrderedDict[int, None] = OrderedDict()
    for s in shard.tolist():  # one rank's batches come in position order
        if s in cache0:
            cache0.move_to_end(s)
            continue
        machine += int(shard_bytes[s])
        cache0[s] = None
        if len(cache0) > capacity:
            cache0.popitem(last=False)
    read = 0
    for w in range(workers):
        positions = np.concatenate([p for p, _ in plan.iter_worker_chunks(0, workers, w)])
        seq = np.searchsorted(starts, plan.indices(positions), side="right") - 1
        cache: OrderedDict[int, None] = OrderedDict()
        for s in seq.tolist():
            if s in cache:
                cache.move_to_end(s)
                continue
            read += int(shard_bytes[s])
            cache[s] = None
            if len(cache) > capacity:
                cache.popitem(last=False)
    return {
        "spearman": spearman(order),
        "same_shard": float(np.mean(shard[1:] == shard[:-1])),
        "displacement": float(np.mean(np.abs(order - np.arange(n))) / n),
        "bytes_read_x": read / n,
        "machine_read_x": machine / n,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--samples", type=int, default=200_000)
    ap.add_argument("--shards", type=int, default=64)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--cache-shards", type=int, default=8, help="LRU cache size, in shards")
    ap.add_argument("--windows", type=int, nargs="*", default=[1, 2, 4, 8, 16])
    ap.add_argument("--epochs", type=int, default=3)
    args = ap.parse_args()
    sizes = np.full(args.shards, args.samples // args.shards)
    sizes[: args.samples % args.shards] += 1
    starts = np.concatenate([[0], np.cumsum(sizes)])
    shard_sizes = tuple(sizes.tolist())

    def plan_of(mode: str, k: int, epoch: int) -> EpochPlan:
        order = make_order(
            mode, args.samples, seed=0, epoch=epoch, shard_sizes=shard_sizes, block_shards=k
        )
        return EpochPlan(
            num_samples=args.samples, batch_size=args.batch_size, epoch=epoch, order=order
        )

    modes = [("global", "global", 0)] + [(f"block(K={k})", "block", k) for k in args.windows]
    print(
        f"N={args.samples:,} samples in {args.shards} shards, {args.workers} workers, batch "
        f"{args.batch_size}, LRU cache of {args.cache_shards} shards per worker; "
        f"ideal same-shard rate 1/{args.shards} = {1 / args.shards:.4f}"
    )
    print(
        f"{'mode':<12} {'|spearman|':>10} {'same-shard':>11} {'displacement':>13} "
        f"{'read/epoch (worker cache)':>26} {'(machine cache)':>16}"
    )
    for name, mode, k in modes:
        runs = [
            measure(plan_of(mode, k, e), starts, args.workers, args.cache_shards)
            for e in range(args.epochs)
        ]
        m = {k: float(np.mean([abs(r[k]) for r in runs])) for k in runs[0]}
        print(
            f"{name:<12} {m['spearman']:>10.4f} {m['same_shard']:>11.4f} "
            f"{m['displacement']:>13.4f} {m['bytes_read_x']:>25.2f}x "
            f"{m['machine_read_x']:>15.2f}x"
        )


if __name__ == "__main__":
    main()
