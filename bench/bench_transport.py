"""The hand-off alone: 2 readers that only gather 256 random 1 KiB rows from a numpy array
and hand the batch over, next to the same gather in one process.  The readers are worker
processes handing over through torch's hand-off, through evenly's shared-memory slots
copied out (``transport="copy"``) and viewed in place (``"slots"``, zero-copy), or two
reader threads in the main process (``worker_type="thread"``).  Rounds interleave the
contenders; medians [min-max] of rows/s.  This is the ceiling of any 2-worker loader of
the columnar workload in ``bench_formats.py``.

    python bench/bench_transport.py [--rounds 5] [--batches 2000]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Iterator
from functools import partial
from typing import Any

import numpy as np
import torch
import torch.utils.data as tud

from evenly.loader.threads import ThreadPass
from evenly.transport.slots import HOLD, Transport, unpack

ROWS, WIDTH, BATCH, READERS = 200_000, 1024, 256, 2
_DATA: dict[str, np.ndarray] = {}


def rows() -> np.ndarray:
    """The rows, made once per process (shared by threads, copied by fork)."""
    if "rows" not in _DATA:
        _DATA["rows"] = np.random.default_rng(0).integers(0, 256, (ROWS, WIDTH), dtype=np.uint8)
    return _DATA["rows"]


def gather(batches: int, wid: int, workers: int, pack: Any = None) -> Iterator[Any]:
    """Reader ``wid`` of ``workers``: its share of ``batches`` random-row batches."""
    rng = np.random.default_rng(wid)
    data = rows()
    for _ in range(batches // workers):
        idx = rng.integers(0, ROWS, BATCH)
        batch = {"idx": torch.from_numpy(idx), "data": torch.from_numpy(data[idx])}
        yield pack(batch) if pack is not None else batch


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
        return gather(self.batches, wid, workers, writer.pack if writer is not None else None)


class Threads:
    """Two reader threads in this process, taken round robin (evenly's thread path)."""

    def __init__(self, batches: int) -> None:
        self.batches = batches

    def __iter__(self) -> Iterator[Any]:
        reads = [partial(gather, self.batches, w, READERS) for w in range(READERS)]
        return ThreadPass(reads, prefetch=2)


def rate(loader: Any) -> float:
    t0 = time.perf_counter()
    n = 0
    for b in loader:
        n += len(unpack(b)["idx"])
    return n / (time.perf_counter() - t0)


def processes(batches: int, transport: Transport | None) -> tud.DataLoader[Any]:
    return tud.DataLoader(
        Gather(batches, transport),
        batch_size=None,
        num_workers=READERS,
        persistent_workers=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batches", type=int, default=2000)
    args = ap.parse_args()
    n = args.batches
    loaders: dict[str, Any] = {
        "one process": Gather(n, None),
        "2 workers, torch hand-off": processes(n, None),
        "2 workers, slots, copy": processes(n, Transport(READERS, 3, hold=0)),
        "2 workers, slots, zero-copy": processes(n, Transport(READERS, 3, hold=HOLD)),
        "2 threads": Threads(n),
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
    print(
        f"# bench_transport: {BATCH} random rows of {WIDTH} B from {ROWS} per batch, "
        f"{args.batches} batches, {args.rounds} interleaved rounds"
    )
    for name, values in results.items():
        med = statistics.median(values)
        print(
            f"{name:<28} {med:>12,.0f} [{min(values):,.0f}-{max(values):,.0f}] rows/s  "
            f"{med / base:.2f}x [{min(values) / base:.2f}-{max(values) / base:.2f}] "
            f"one process"
        )


if __name__ == "__main__":
    main()
