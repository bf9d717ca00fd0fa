"""One rank of an elastic torchrun job (``--nnodes 1:2``) that tests/test_elastic.py
shrinks and grows: DDP training over an ``evenly.Dataset`` for some epochs, the loader's
state saved with the model every ``--every`` steps (docs/elastic.md's recipe), and per
rank and step the sample ids it trained on written to ``<out>``.

Each start of the worker group (an *attempt*: the first, every restart after a node
left, every restart after a node joined) loads the newest checkpoint, and records which
checkpoint that was, so the test can tell the steps a checkpoint kept from the ones that
were lost with a node and trained again.

The test drives the membership changes through two pauses: with ``--pause-at S`` an
attempt of world size ``--pause-world`` stops after its step S, writes
``<out>/paused-<world>`` and waits (the test then kills a node, or starts one: torchrun
restarts the group either way).  A pause is taken once (its marker stays).

    torchrun --nnodes 1:2 --nproc-per-node 2 --rdzv-backend c10d \\
        --rdzv-endpoint 127.0.0.1:P --max-restarts 3 tests/scripts/elastic_train.py --out D
"""

from __future__ import annotations

import argparse
import json
import os
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import evenly


def features(i: int) -> torch.Tensor:
    return torch.full((4,), float(i))


#: the packed loader's documents: document d holds tokens 100 * d + 1 .. 100 * d + len
DOCUMENTS, SEQ_LEN = 40, 8
#: the Mix: two sources, 32 samples per epoch, weights 1:1 then NEW_WEIGHTS from step 1
MIX_A, MIX_B, MIX_EPOCH = 64, 32, 32
NEW_WEIGHTS = {"a": 3, "b": 1}


def documents() -> list[dict[str, list[int]]]:
    return [{"input_ids": [100 * d + j + 1 for j in range(3 + d % 7)]} for d in range(DOCUMENTS)]


class Stepper:
    """One batch of ``loader`` per call, starting its next epoch when one ends (a loaded
    state continues its interrupted epoch): the batch and the epoch it belongs to."""

    def __init__(self, loader: evenly.DataLoader) -> None:
        self.loader = loader
        self._batches: Iterator[Any] | None = None

    def next(self) -> tuple[Any, int]:
        for _ in range(2):
            if self._batches is None:
                self._batches = iter(self.loader)
            try:
                return next(self._batches), self.loader.epoch
            except StopIteration:
                self._batches = None
        raise AssertionError("an epoch with no batch")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--samples", type=int, default=96)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--every", type=int, default=2)
    parser.add_argument("--pause", action="append", default=[], help="WORLD:STEP")
    args = parser.parse_args()
    pauses = {int(w): int(s) for w, s in (p.split(":") for p in args.pause)}

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    (args.out / f"pid-{os.getpid()}").write_text(str(os.getppid()))  # the agent (the node)
    token = [uuid.uuid4().hex if rank == 0 else None]
    dist.broadcast_object_list(token, src=0)  # one name for this attempt on every rank
    attempt = token[0]

    model = nn.parallel.DistributedDataParallel(nn.Linear(4, 1))
    optimiser = torch.optim.SGD(model.parameters(), lr=1e-4)
    ds = evenly.Dataset(list(range(args.samples)), shuffle=True, seed=3)
    loader = evenly.DataLoader(ds, batch_size=args.batch_size, num_workers=args.workers)
    # two more loaders stepped with the first one, one batch each per step, checkpointed
    # with it: packed token rows, and a Mix whose weights change at the first start's step 1
    # (min_step= the per-rank batch: the Mix may resume onto fewer ranks)
    packed = evenly.DataLoader(
        evenly.Dataset(documents(), shuffle=True, seed=5, pack=evenly.Packing(SEQ_LEN, pad_id=0)),
        batch_size=2,
    )
    mix = evenly.Mix(
        {"a": list(range(1000, 1000 + MIX_A)), "b": list(range(2000, 2000 + MIX_B))},
        weights={"a": 1, "b": 1},
        samples_per_epoch=MIX_EPOCH,
        min_step=2,
    )
    mixed = evenly.DataLoader(evenly.Dataset(mix, shuffle=True, seed=7), batch_size=2)
    side = {"packed": Stepper(packed), "mixed": Stepper(mixed)}

    ckpt_path = args.out / "ckpt.pt"
    start = {"attempt": None, "step": 0}
    if ckpt_path.exists():
        ckpt = torch.load(ckpt_path, weights_only=False)
        model.load_state_dict(ckpt["model"])
        optimiser.load_state_dict(ckpt["optimiser"])
        loader.load_state_dict(ckpt["loader"])
        for name, stepper in side.items():
            stepper.loader.load_state_dict(ckpt[name])
        start = {"attempt": ckpt["attempt"], "step": ckpt["step"]}
    log = (args.out / f"log-{attempt}-rank{rank}.jsonl").open("w")
    log.write(json.dumps({"world": world, "rank": rank, "start": start}) + "\n")
    log.flush()

    step = 0
    while loader.epoch < args.epochs:
        for ids in loader:
            x = torch.stack([features(int(i)) for i in ids])
            loss = model(x).pow(2).mean()
            optimiser.zero_grad()
            loss.backward()  # DDP's all-reduce: a rank that is gone stops everyone here
            optimiser.step()
            rows, tokens_epoch = side["packed"].next()
            mixed_ids, mix_epoch = side["mixed"].next()
            step += 1
            if start["attempt"] is None and step == 1:  # every rank, at the same batch
                mixed.set_weights(NEW_WEIGHTS)
            record = {"step": step, "epoch": loader.epoch, "ids": ids.tolist()}
            tokens = rows["input_ids"][rows["input_ids"] != 0].tolist()
            record.update(tokens=tokens, tokens_epoch=tokens_epoch)
            record.update(mixed=mixed_ids.tolist(), mixed_epoch=mix_epoch)
            log.write(json.dumps(record))
            log.write("\n")
            log.flush()
            if step % args.every == 0:
                state = loader.state_dict()  # the same on every rank
                if rank == 0:
                    tmp = ckpt_path.with_suffix(".tmp")
                    torch.save(
                        {
                            "model": model.state_dict(),
                            "optimiser": optimiser.state_dict(),
                            "loader": state,
                            **{name: st.loader.state_dict() for name, st in side.items()},
                            "attempt": attempt,
                            "step": step,
                        },
                        tmp,
                    )
                    os.replace(tmp, ckpt_path)
                dist.barrier()
            marker = args.out / f"paused-{world}"
            if pauses.get(world) == step and not marker.exists():
                dist.barrier()
                if rank == 0:
                    marker.write_text(attempt)
                while True:  # until torchrun restarts the group (a node left or joined):
                    time.sleep(0.2)  # a collective notices a node that is gone
                    dist.all_reduce(torch.zeros(1))
    log.write(json.dumps({"done": True}) + "\n")
    log.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
