"""What the per-epoch plan agreement check costs: one all_gather_object of a small dict
over 2 real gloo ranks on 127.0.0.1, against the cost of starting an epoch without it.

    python bench/bench_agreement.py
"""

from __future__ import annotations

import os
import socket
import statistics
import time

import torch.distributed as dist
import torch.multiprocessing as mp

import evenly
from evenly.runtime.agreement import check_agreement

REPEATS = 200


def first_batch_seconds(loader: evenly.DataLoader) -> float:
    t0 = time.perf_counter()
    next(iter(loader))
    return time.perf_counter() - t0


def rank_main(rank: int, world: int, port: int, queue: mp.Queue) -> None:  # type: ignore[type-arg]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    ds = evenly.Dataset(list(range(100_000)), shuffle=True)
    loader = evenly.DataLoader(ds, batch_size=256)
    view = loader._view(ds.plan())
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        check_agreement(view)
        times.append(time.perf_counter() - t0)
    with_check = [first_batch_seconds(loader) for _ in range(50)]
    loader.agreement_timeout = None
    without = [first_batch_seconds(loader) for _ in range(50)]
    if rank == 0:
        queue.put(
            (statistics.median(times), statistics.median(with_check), statistics.median(without))
        )
    dist.destroy_process_group()


def main() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, 2, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    check, with_check, without = queue.get(timeout=300)
    for p in procs:
        p.join()
    print("# plan agreement check, 2 gloo ranks on 127.0.0.1 (median)")
    print(f"one check (all_gather_object):          {check * 1e3:.2f} ms per epoch")
    print(f"iter(loader) to first batch, check on:  {with_check * 1e3:.2f} ms")
    print(f"iter(loader) to first batch, check off: {without * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
