"""Real torch.distributed process groups (gloo, 127.0.0.1), each rank with real workers."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
import torch.distributed as dist

import evenly
from tests.distributed import run_ranks
from tests.test_dataset import map_style_batches, record_draws

N, BATCH = 50, 4


def train_two_epochs(rank: int, world: int) -> dict[str, Any]:
    # no rank/world_size given: they come from the initialised process group
    ds = evenly.Dataset(list(range(N)), shuffle=True, seed=9, transform=record_draws)
    loader = evenly.DataLoader(ds, batch_size=BATCH, num_workers=2)
    assert dist.is_initialized() and ds.topology() == evenly.core.Topology(rank, world)
    epochs, draws = [], {}
    for epoch in range(2):
        batches = []
        for x, a, b, c in loader:
            batches.append(x.tolist())
            for i, xa, xb, xc in zip(x.tolist(), a, b, c, strict=True):
                draws[(epoch, i)] = (float(xa), float(xb), float(xc))
            # every rank joins a collective per batch, as DDP's backward does
            dist.all_reduce(torch.ones(1))
        epochs.append(batches)
    return {"epochs": epochs, "len": len(loader), "padded": loader.plan.num_padded, "draws": draws}


_RUNS: dict[int, list[dict[str, Any]]] = {}


def ddp_run(world: int) -> list[dict[str, Any]]:
    """One real process group per world size, shared by the tests of this module."""
    if world not in _RUNS:
        _RUNS[world] = run_ranks(train_two_epochs, world, env={"PYTHONWARNINGS": "ignore"})
    return _RUNS[world]


@pytest.mark.parametrize("world", [2, 3])
def test_ddp_exactly_once_equal_batches_map_style_order(world: int) -> None:
    results = ddp_run(world)
    padded = results[0]["padded"]
    assert padded == (-N) % world
    for epoch in range(2):
        union = Counter(x for r in results for b in r["epochs"][epoch] for x in b)
        assert set(union) == set(range(N)) and sum(union.values()) == N + padded
        counts = {len(r["epochs"][epoch]) for r in results}
        assert counts == {results[0]["len"]}
        for rank, r in enumerate(results):
            expected = map_style_batches(N, world, rank, BATCH, shuffle=True, seed=9, epoch=epoch)
            assert r["epochs"][epoch] == expected
    assert results[0]["epochs"][0] != results[0]["epochs"][1]


def test_ddp_draws_match_a_single_process_run() -> None:
    results = ddp_run(2)
    merged = {**results[0]["draws"], **results[1]["draws"]}
    single: dict[tuple[int, int], Any] = {}
    ds = evenly.Dataset(list(range(N)), shuffle=True, seed=9, transform=record_draws)
    loader = evenly.DataLoader(ds, batch_size=BATCH, num_workers=0)
    for epoch in range(2):
        for x, a, b, c in loader:
            for i, xa, xb, xc in zip(x.tolist(), a, b, c, strict=True):
                single[(epoch, i)] = (float(xa), float(xb), float(xc))
    # a padded repeat has its own position, hence its own draws; all others agree
    assert {k: merged[k] for k in single} == single
