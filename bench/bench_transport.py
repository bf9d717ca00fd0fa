"""The hand-off alone: 2 workers that only gather 256 random 1 KiB rows from a numpy array
and hand the batch over, through torch's hand-off and through evenly's shared-memory
slots, next to the same gather in one process.  Rounds interleave the contenders; medians
[min-max] of rows/s.  This is the ceiling of any 2-worker loader of the columnar workload
in ``bench_formats.py``.

    python bench/bench_transport.py [--rounds 3] [--batches 2000]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torch.utils.data as tud

from evenly.transport.slots import Transport, unpack

ROWS, WIDTH, BATCH = 200_000, 1024, 256


class Gather(tud.IterableDataset[Any]):
    def __init__(self, batches: int, transport: Transport | None) -> None:
        self.batches = batches
        self.transport = transport

    def __iter__(self) -> Iterator[Any]:
        info = tud.get_worker_info()
        workers, wid = (info.num_workers, info.id) if info is not None else (1, 0)
        writer = self.transport.writer(wid) if self.transport is not None else None
        if writer is not None:
            writer.reclaim()
        rng = np.random.default_rng(wid)
        data = np.random.default_rng(0).integers(0, 256, (ROWS, WIDTH), dtype=np.uint8)
        for _ in range(self.batches // workers):
            idx = rng.integers(0, ROWS, BATCH)
            batch = {"idx": torch.from_numpy(idx), "data": torch.from_numpy(data[idx])}
            yield writer.pack(batch) if writer is not None else batch


def rate(loader: Any) -> float:
    t0 = time.perf_counter()
    n = 0
    for b in loader:
        n += len(unpack(b)["idx"])
    return n / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batches", type=int, default=2000)
    args = ap.parse_args()
    loaders: dict[str, Any] = {
        "one process": Gather(args.batches, None),
        "2 workers, torch hand-off": tud.DataLoader(
            Gather(args.batches, None), batch_size=None, num_workers=2, persistent_workers=True
        ),
        "2 workers, evenly slots": tud.DataLoader(
            Gather(args.batches, Transport(2, slots=3)),
            batch_size=None,
            num_workers=2,
            persistent_workers=True,
        ),
    }
    for loader in loaders.values():  # warm-up: start workers, fault pages in
        rate(loader)
    results: dict[str, list[float]] = {k: [] for k in loaders}
    for r in range(args.rounds):
        names = list(loaders)
        names = names[r % len(names) :] + names[: r % len(names)]
        for name in names:
            results[name].append(rate(loaders[name]))
    base = statistics.median(results["one process"])
    print(f"# bench_transport: {BATCH} random rows of {WIDTH} B from {ROWS} per batch, "
          f"{args.batches} batches, {args.rounds} interleaved rounds")  # fmt: skip
    for name, values in results.items():
        med = statistics.median(values)
        print(f"{name:<28} {med:>12,.0f} [{min(values):,.0f}-{max(values):,.0f}] rows/s  "
              f"{med / base:.2f}x one process")  # fmt: skip


if __name__ == "__main__":
    main()
