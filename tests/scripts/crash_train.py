"""A DDP training script that checkpoints model + loader state every K steps and logs,
per rank and step, the sample ids it trained on.  tests/test_crash_resume.py SIGKILLs
it mid-epoch and restarts it from the last checkpoint.

    torchrun --nproc-per-node 2 tests/scripts/crash_train.py --ckpt C --log-dir D --tag 1
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import evenly


def features(i: int) -> torch.Tensor:
    return torch.full((4,), float(i))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", type=Path, required=True)
    parser.add_argument("--log-dir", type=Path, required=True)
    parser.add_argument("--tag", required=True)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--samples", type=int, default=640)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--sleep", type=float, default=0.0)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    (args.log_dir / f"rank{rank}.pid").write_text(str(os.getpid()))
    model = nn.parallel.DistributedDataParallel(nn.Linear(4, 1))
    optimiser = torch.optim.SGD(model.parameters(), lr=1e-4)
    ds = evenly.Dataset(list(range(args.samples)), shuffle=True, seed=1)
    loader = evenly.DataLoader(ds, batch_size=args.batch_size, num_workers=args.workers)

    step = 0
    if args.ckpt.exists():
        ckpt = torch.load(args.ckpt, weights_only=False)
        model.load_state_dict(ckpt["model"])
        optimiser.load_state_dict(ckpt["optimiser"])
        loader.load_state_dict(ckpt["loader"])
        step = ckpt["step"]

    log = (args.log_dir / f"rank{rank}.log").open("a")
    for ids in loader:  # the rest of the epoch (all of it on a first run)
        x = torch.stack([features(int(i)) for i in ids])
        loss = model(x).pow(2).mean()
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
        log.write(f"{args.tag} {loader.epoch} {step} {' '.join(map(str, ids.tolist()))}\n")
        log.flush()
        step += 1
        if step % args.every == 0:
            state = loader.state_dict()  # the same on every rank
            if rank == 0:
                tmp = args.ckpt.with_suffix(".tmp")
                torch.save(
                    {
                        "model": model.state_dict(),
                        "optimiser": optimiser.state_dict(),
                        "loader": state,
                        "step": step,
                    },
                    tmp,
                )
                os.replace(tmp, args.ckpt)
            dist.barrier()
        time.sleep(args.sleep)
    log.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
