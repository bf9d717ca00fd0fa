"""evenly.Mix under real torch.distributed (2 gloo ranks, 2 DataLoader workers each):
exact per-source counts per epoch, equal batches, the same batches as simulated ranks, and
a mid-epoch state that every rank agrees on and that resumes exactly."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import evenly
from evenly.mixture import Mix
from tests.distributed import run_ranks

LENGTHS = {"web": 29, "code": 6, "books": 1}
WEIGHTS = {"web": 0.6, "code": 0.3, "books": 0.1}
TOTAL, BATCH = 48, 4


def make_mix() -> Mix:
    return Mix(
        {name: list(range(1000 * d, 1000 * d + n)) for d, (name, n) in enumerate(LENGTHS.items())},
        weights=WEIGHTS,
        samples_per_epoch=TOTAL,
    )


def train(rank: int, world: int) -> dict[str, Any]:
    # no rank/world_size given: they come from the initialised process group
    loader = evenly.DataLoader(
        evenly.Dataset(make_mix(), shuffle=True, seed=3), batch_size=BATCH, num_workers=2
    )
    epochs = []
    for _ in range(2):
        batches = []
        for batch in loader:
            batches.append(batch.tolist())
            dist.all_reduce(torch.ones(1))  # a collective per batch, as DDP's backward
        epochs.append(batches)
    it = iter(loader)
    for _ in range(3):
        next(it)
    state = json.loads(json.dumps(loader.state_dict()))
    del it
    return {"epochs": epochs, "len": len(loader), "state": state}


def simulated(world: int, epochs: int) -> list[list[list[list[int]]]]:
    lds = [
        evenly.DataLoader(
            evenly.Dataset(make_mix(), shuffle=True, seed=3, rank=r, world_size=world),
            batch_size=BATCH,
        )
        for r in range(world)
    ]
    return [[[b.tolist() for b in ld] for ld in lds] for _ in range(epochs)]


def test_ddp_two_ranks_exact_counts_equal_batches_and_an_agreed_state() -> None:
    results = run_ranks(train, 2, env={"PYTHONWARNINGS": "ignore"})
    counts = list(make_mix().counts.values())
    reference = simulated(2, 3)
    for epoch in range(2):
        assert [len(r["epochs"][epoch]) for r in results] == [results[0]["len"]] * 2 == [6, 6]
        ids = np.array([x for r in results for b in r["epochs"][epoch] for x in b])
        assert np.bincount(ids // 1000, minlength=3).tolist() == counts
        assert [r["epochs"][epoch] for r in results] == reference[epoch]
    # every rank saved the same state after 3 batches of epoch 2; a single process
    # resumes it (another world size) with exactly the rest of the epoch
    states = [r["state"] for r in results]
    assert states[0] == states[1] and states[0]["position"] == 3 * 2 * BATCH
    loader = evenly.DataLoader(
        evenly.Dataset(make_mix(), shuffle=True, seed=3, rank=0, world_size=1), batch_size=8
    )
    loader.load_state_dict(states[0])
    rest = [x for b in loader for x in b.tolist()]
    first = [x for rank in reference[2] for b in rank[:3] for x in b]
    full = [x for rank in reference[2] for b in rank for x in b]
    assert Counter(first + rest) == Counter(full)
