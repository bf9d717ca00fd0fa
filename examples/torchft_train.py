"""One replica group of a fault-tolerant job (torchft), reading an ``evenly.Dataset``
with ``evenly.interop.torchft.FaultTolerantLoader`` (docs/elastic.md, "torchft").

Start a lighthouse, then each replica group as a torchrun job of its own (kill one, start
it again: the others keep stepping; it heals and joins)::

    torchft_lighthouse --min_replicas 2 --join_timeout_ms 1000 --heartbeat_timeout_ms 3000 &
    for g in 0 1; do
      TORCHFT_LIGHTHOUSE=http://localhost:29510 REPLICA_GROUP_ID=$g \\
        torchrun --nproc-per-node 1 --master-port $((29600 + g)) examples/torchft_train.py &
    done

Every sample of an epoch is in exactly one committed step over all groups; at the end
each group prints how many samples it trained in committed steps (two groups over two
epochs of 4096: 4096 each, if neither died).  With ``--checkpoint PATH`` group 0 saves the
Manager's, the model's and the loader's states every 20 steps; a restart of the whole
job resumes from there, onto any number of groups.
"""

from __future__ import annotations

import argparse
import os
from datetime import timedelta

import torch
from torch import nn
from torchft import Manager, Optimizer, ProcessGroupGloo

import evenly
from evenly.interop.torchft import FaultTolerantLoader


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--global-batch-size", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--checkpoint", default="", help="group 0 saves here every 20 steps")
    args = parser.parse_args()

    group = int(os.environ.get("REPLICA_GROUP_ID", 0))
    torch.manual_seed(0)  # the same initial weights in every group: init_sync=False
    model = nn.Linear(8, 1)
    inner = torch.optim.SGD(model.parameters(), lr=1e-3)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=30)),
        load_state_dict=lambda s: (
            model.load_state_dict(s["model"]),
            inner.load_state_dict(s["optim"]),
        ),
        state_dict=lambda: {"model": model.state_dict(), "optim": inner.state_dict()},
        min_replica_size=1,
        init_sync=False,
        replica_id=f"group{group}",
        timeout=timedelta(seconds=30),
    )
    optimizer = Optimizer(manager, inner)
    data = torch.randn(args.samples, 8)
    dataset = evenly.Dataset(data, shuffle=True, seed=0)  # this group's ranks: torchrun's
    loader = FaultTolerantLoader(dataset, manager, global_batch_size=args.global_batch_size)
    if args.checkpoint and os.path.exists(args.checkpoint):  # a restart of the whole job
        saved = torch.load(args.checkpoint, weights_only=False)
        manager.load_state_dict(saved["torchft"])
        model.load_state_dict(saved["model"])
        inner.load_state_dict(saved["optim"])
        loader.load_state_dict(saved["loader"])

    trained = 0
    while loader.epoch < args.epochs:
        batches = iter(loader)
        while True:
            optimizer.zero_grad()  # torchft: this step's quorum
            batch = next(batches, None)  # this group's slice of the step's global batch
            if batch is None:
                break  # every global batch of the epoch is in a committed step
            step = manager.current_step()
            model(batch).pow(2).mean().backward()
            for p in model.parameters():  # data parallel across the groups of the quorum
                assert p.grad is not None
                manager.allreduce(p.grad).wait()
            optimizer.step()  # applied only if torchft commits the step
            if manager.current_step() > step and loader.participating:
                trained += len(batch)
            save = args.checkpoint and group == 0 and dataset.topology().rank == 0
            if save and manager.current_step() % 20 == 0:
                state = {"torchft": manager.state_dict(), "model": model.state_dict()}
                state.update(optim=inner.state_dict(), loader=loader.state_dict())
                torch.save(state, args.checkpoint + ".tmp")
                os.replace(args.checkpoint + ".tmp", args.checkpoint)
    state = loader.state_dict()
    print(f"group {group}: {trained} samples in committed steps; at epoch {state['epoch']}")
    manager.shutdown(wait=False)


if __name__ == "__main__":
    main()
