"""One replica group (one process) of a torchft job that tests/test_torchft.py shrinks and
grows: data parallel across groups through torchft's Manager (gloo on CPU, the lighthouse
at ``--lighthouse``), an ``evenly.Dataset`` over Parquet read by
``evenly.interop.torchft.FaultTolerantLoader`` (docs/elastic.md's torchft recipe).

Gradients are all-reduced with ``manager.allreduce``: torchft 0.2.0's
``DistributedDataParallel`` fails an assertion (``assert fut._fut`` in its comm hook)
when a peer dies during the all-reduce, which kills the surviving groups too.

After every step it appends to ``<out>/log-<group>-<pid>.jsonl`` the manager's step, whether
torchft committed it, whether this group took part, the quorum's group count and the
sample ids it trained on.

The test drives the membership changes.  The groups start together once
``<out>/start`` exists.  With ``--die-at S`` a group SIGKILLs itself in step S, after
taking its batch and before the all-reduce (so the others' step S fails); the test starts
it again.  With ``--hold``, a group that committed a step in a quorum of 2 groups
writes ``<out>/held-<group>`` and waits for ``<out>/release`` (the test releases it once
the restarted group is up, so that the rejoin happens mid-epoch).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed import TCPStore
from torchft import Manager, Optimizer, ProcessGroupGloo

import evenly
from evenly.interop.torchft import FaultTolerantLoader


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--lighthouse", required=True)
    parser.add_argument("--group", type=int, required=True)
    parser.add_argument("--global-batch-size", type=int, default=6)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--delay", type=float, default=0.0)
    parser.add_argument("--hold", action="store_true")
    parser.add_argument("--die-at", type=int, default=-1, help="SIGKILL itself in that step")
    args = parser.parse_args()

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # the group's
    port = store.port
    torch.manual_seed(0)  # every group starts from the same weights (init_sync=False)
    model = nn.Linear(1, 1)
    optimiser = torch.optim.SGD(model.parameters(), lr=1e-3)
    seconds = timedelta(seconds=20)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=seconds),
        load_state_dict=lambda state: (
            model.load_state_dict(state["model"]),
            optimiser.load_state_dict(state["optimiser"]),
        ),
        state_dict=lambda: {"model": model.state_dict(), "optimiser": optimiser.state_dict()},
        min_replica_size=1,
        use_async_quorum=True,
        init_sync=False,
        timeout=seconds,
        quorum_timeout=timedelta(seconds=60),
        connect_timeout=seconds,
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=port,
        lighthouse_addr=args.lighthouse,
        replica_id=f"group{args.group}",
        hostname="127.0.0.1",
    )
    optimizer = Optimizer(manager, optimiser)
    dataset: evenly.Dataset[Any] = evenly.Dataset(
        evenly.from_parquet(str(args.data)), shuffle=True, seed=5, rank=0, world_size=1
    )
    loader = FaultTolerantLoader(dataset, manager, global_batch_size=args.global_batch_size)

    log = (args.out / f"log-{args.group}-{os.getpid()}.jsonl").open("w")
    (args.out / f"ready-{args.group}-{os.getpid()}").touch()
    while not (args.out / "start").exists():  # the first quorum: every group heartbeating
        time.sleep(0.05)
    while loader.epoch < args.epochs:
        epoch = loader.epoch
        batches = iter(loader)
        while True:
            optimizer.zero_grad()  # torchft: this step's quorum
            batch = next(batches, None)
            if batch is None:
                break
            step = manager.current_step()  # after the quorum (a healing group's is set)
            if step == args.die_at:  # before the all-reduce: the others' step fails
                os.kill(os.getpid(), signal.SIGKILL)
            x = batch["x"].float().unsqueeze(1)
            model(x).pow(2).mean().backward()
            for p in model.parameters():  # DDP across the groups of the quorum
                assert p.grad is not None
                manager.allreduce(p.grad).wait()  # a failure makes should_commit() false
            optimizer.step()  # should_commit: torchft's step count moves on if committed
            record = {
                "step": step,
                "epoch": epoch,
                "committed": manager.current_step() > step,
                "participating": loader.participating,
                "groups": manager.num_participants(),
                "ids": batch["id"].tolist(),
            }
            log.write(json.dumps(record) + "\n")
            log.flush()
            time.sleep(args.delay)
            if args.hold and record["committed"] and record["groups"] == 2:
                (args.out / f"held-{args.group}").touch()
                while not (args.out / "release").exists():
                    time.sleep(0.1)
    log.write(json.dumps({"done": True, "state": loader.state_dict()}) + "\n")
    log.close()
    manager.shutdown(wait=False)
    del store


if __name__ == "__main__":
    main()
