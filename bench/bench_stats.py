"""What ``loader.stats()`` costs: a paired micro-benchmark, not an end-to-end run.

Per batch, the stats add a fixed set of operations: clock reads and sums in the worker
(read, collate, and the hand-off with workers; a transform would add its own), one
``StageClock.take()`` tuple that travels with the batch (pickled with it through
torch's queue; with no workers the clock itself goes with it), and in the main process
``PassRecorder.add``.  This script times exactly those operations on the real
objects, paired round by round with the same loop without them, and divides by the time
of a batch on the cheapest real workload (in-memory integers, default collate): the
fraction of throughput the stats cost, at several batch sizes.

    python bench/bench_stats.py            # ~20 s
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import time
from typing import Any

import evenly
from evenly.loader.stats import StatsLog
from evenly.runtime.clock import StageClock, perf_counter


def stats_ops(n: int, pickled: bool) -> float:
    """Seconds for ``n`` batches' worth of the stats' own operations on the workload
    timed below (no transform, default collate); ``pickled``: the batch crosses a
    process in a slot, as with workers (the hand-off is timed, and the copy-out)."""
    clock, recorder = StageClock(), StatsLog().begin(0)
    item = ("a batch's slot descriptor", 0, 3)
    started_all = time.perf_counter()
    for _ in range(n):
        # reader: fetch (a transform would be timed too: this workload has none)
        started = perf_counter()
        clock.read += perf_counter() - started
        clock.samples += 256
        # planner: collate
        started = perf_counter()
        clock.collate += perf_counter() - started
        # feed: the hand-off into the slot (workers only); the times travel with the batch
        if pickled:
            started = perf_counter()
            clock.handoff += perf_counter() - started
            payload: tuple[Any, Any] = (item, clock.take())
            payload = pickle.loads(pickle.dumps(payload, pickle.HIGHEST_PROTOCOL))
        else:  # read in the main process: the clock itself goes with the batch
            payload = (item, clock)
        # main process
        begun = perf_counter()
        if recorder.started is None:
            recorder.started = begun
        got = perf_counter()
        recorder.add(payload[1], begun, got, pickled)
    return time.perf_counter() - started_all


def bare_ops(n: int, pickled: bool) -> float:
    """The same loop without the stats: the item alone (through pickle)."""
    item = ("a batch's slot descriptor", 0, 3)
    started_all = time.perf_counter()
    for _ in range(n):
        if pickled:
            pickle.loads(pickle.dumps(item, pickle.HIGHEST_PROTOCOL))
    return time.perf_counter() - started_all


def batch_seconds(batch: int, workers: int, n: int) -> float:
    """Seconds per batch of an epoch over ``n`` in-memory integers (epoch 2 timed)."""
    ds = evenly.Dataset(list(range(n)), shuffle=True)
    loader = evenly.DataLoader(ds, batch_size=batch, num_workers=workers)
    sum(len(b) for b in loader)
    started = time.perf_counter()
    batches = sum(1 for _ in loader)
    return (time.perf_counter() - started) / batches


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--batches", type=int, default=20_000)
    args = parser.parse_args()
    cost = {}
    for pickled in (False, True):
        costs = []
        for _ in range(args.rounds):  # paired: each round times both loops back to back
            extra = stats_ops(args.batches, pickled) - bare_ops(args.batches, pickled)
            costs.append(extra / args.batches)
        cost[pickled] = statistics.median(costs)
        print(
            f"stats' own work per batch{' (pickled)' if pickled else ''}: "
            f"{cost[pickled] * 1e6:.2f} us (median of {args.rounds} paired rounds, "
            f"[{min(costs) * 1e6:.2f}-{max(costs) * 1e6:.2f}])"
        )
    print(f"{'batch':>6} {'workers':>7} {'us/batch':>9} {'stats overhead':>15}")
    for batch in (32, 256):
        for workers in (0, 2):
            per = statistics.median(batch_seconds(batch, workers, 100_000) for _ in range(3))
            # with k workers the worker-side part runs in parallel: the loop still pays
            # the main-process part; the whole cost against the batch time bounds both
            extra = cost[workers > 0]
            print(f"{batch:>6} {workers:>7} {per * 1e6:>9.1f} {extra / per:>14.2%}")


if __name__ == "__main__":
    main()
