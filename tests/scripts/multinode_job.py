"""One rank of a simulated multi-node job: tests/test_multinode.py starts two torchrun
launchers on 127.0.0.1 (node ranks 0 and 1, 2 processes each) that run this script.

Each rank reads an ``evenly.Dataset`` through ``evenly.DataLoader(num_workers=2)`` for
some epochs, joins one all_reduce per batch as DDP's backward would, and writes what it
received (its global RANK, LOCAL_RANK, node, and per epoch the batches with the worker
that read each sample) to ``<out>/rank<RANK>.json``.  Nothing is gathered: the test
compares the files.

    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 2 --master-addr 127.0.0.1 \
        --master-port P tests/scripts/multinode_job.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import get_worker_info

import evenly


def tag(index: int) -> tuple[int, int, int]:
    """The sample with the id and pid of the DataLoader worker that read it."""
    info = get_worker_info()
    assert info is not None, "samples must be read in DataLoader workers"
    return index, info.id, os.getpid()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--samples", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()

    rank = int(os.environ["RANK"])
    (args.out / f"rank{rank}.pid").write_text(str(os.getpid()))
    dist.init_process_group("gloo")
    assert dist.get_rank() == rank

    ds = evenly.Dataset(list(range(args.samples)), shuffle=True, seed=args.seed, transform=tag)
    loader = evenly.DataLoader(ds, batch_size=args.batch_size, num_workers=args.workers)
    epochs = []
    for _ in range(args.epochs):
        batches, workers, pids = [], [], []
        plan = loader.plan
        for ids, worker, pid in loader:
            batches.append(ids.tolist())
            workers.append(sorted(set(worker.tolist())))
            pids.append(sorted(set(pid.tolist())))
            dist.all_reduce(torch.ones(1))
        epochs.append(
            {
                "epoch": plan.epoch,
                "num_batches": plan.num_batches,
                "num_padded": plan.num_padded,
                "batches": batches,
                "workers": workers,
                "pids": pids,
            }
        )
    record = {
        "rank": rank,
        "dist_rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "node": int(os.environ["GROUP_RANK"]),
        "topology": [ds.topology().rank, ds.topology().world_size],
        "main_pid": os.getpid(),
        "epochs": epochs,
    }
    tmp = args.out / f"rank{rank}.json.tmp"
    tmp.write_text(json.dumps(record))
    os.replace(tmp, args.out / f"rank{rank}.json")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
