"""Time to the first batch after resuming at 1%, 50% and 99% of an N = 10**7 epoch.

evenly loads a state of a few integers and computes the remaining positions directly; a
replaying loader has to produce and throw away everything before the resume point.
Peers shown side by side:

- replay: a map-style DataLoader (RandomSampler with a fixed generator) that skips the
  first k batches, which is what a hand-written resume does;
- torchdata's StatefulDataLoader over a plain IterableDataset (it fast-forwards by
  replaying), when torchdata is installed (bench extras).

    python bench/bench_resume.py [--n 10000000] [--workers 0]
"""

from __future__ import annotations

import argparse
import itertools
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.utils.data as tud

import evenly

BATCH = 256


class Range(tud.IterableDataset[int]):
    """A plain iterable dataset (no state of its own), for the replaying peer."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.n))


def evenly_resume(n: int, fraction: float, workers: int) -> float:
    source = range(n)
    saver = evenly.DataLoader(evenly.Dataset(source, shuffle=True), batch_size=BATCH)
    state = saver.state_dict()
    state["position"] = int(n * fraction) // BATCH * BATCH
    t0 = time.perf_counter()
    loader = evenly.DataLoader(
        evenly.Dataset(source, shuffle=True), batch_size=BATCH, num_workers=workers
    )
    loader.load_state_dict(state)
    next(iter(loader))
    return time.perf_counter() - t0


def replay_resume(n: int, fraction: float, workers: int) -> float:
    skip = int(n * fraction) // BATCH
    t0 = time.perf_counter()
    source = range(n)
    sampler = tud.RandomSampler(source, generator=torch.Generator().manual_seed(0))
    loader = tud.DataLoader(source, batch_size=BATCH, sampler=sampler, num_workers=workers)
    next(itertools.islice(iter(loader), skip, None))
    return time.perf_counter() - t0


def torchdata_resume(n: int, fraction: float, workers: int) -> float | None:
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError:
        return None
    skip = int(n * fraction) // BATCH
    first = StatefulDataLoader(Range(n), batch_size=BATCH, num_workers=workers)
    it = iter(first)
    for _ in range(skip):
        next(it)
    state = first.state_dict()
    del it, first
    t0 = time.perf_counter()
    loader = StatefulDataLoader(Range(n), batch_size=BATCH, num_workers=workers)
    loader.load_state_dict(state)
    next(iter(loader))
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=10**7)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--no-torchdata", action="store_true")
    args = parser.parse_args()
    fractions = (0.01, 0.5, 0.99)
    rows: dict[str, list[float | None]] = {"evenly": [], "replay (skip k batches)": []}
    if not args.no_torchdata:
        rows["torchdata StatefulDataLoader"] = []
    for f in fractions:
        rows["evenly"].append(evenly_resume(args.n, f, args.workers))
        rows["replay (skip k batches)"].append(replay_resume(args.n, f, args.workers))
        if not args.no_torchdata:
            rows["torchdata StatefulDataLoader"].append(torchdata_resume(args.n, f, args.workers))
    print(
        f"# time to first batch after resume, N={args.n:.0e}, batch {BATCH}, {args.workers} workers"
    )
    print(f"{'loader':<32}" + "".join(f"{f:>10.0%}" for f in fractions) + "   99%/1%")
    for name, times in rows.items():
        if any(t is None for t in times):
            print(f"{name:<32}  (not installed)")
            continue
        values: list[Any] = times
        cells = "".join(f"{t:>9.3f}s" for t in values)
        print(f"{name:<32}{cells}   {values[-1] / values[0]:.2f}x")
    e99 = rows["evenly"][-1]
    r99 = rows["replay (skip k batches)"][-1]
    if e99 and r99:
        print(f"at 99%: replay / evenly = {r99 / e99:.0f}x")


if __name__ == "__main__":
    main()
