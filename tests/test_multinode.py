"""Two torchrun launchers on 127.0.0.1 simulate a 2-node job (2 processes per node, 2
DataLoader workers per process).  From the per-rank files that tests/scripts/
multinode_job.py writes, check that the global rank (never LOCAL_RANK) drives the split:
exactly once per epoch over the 4 ranks, equal batch counts, and each rank's batches are
the pure plan's for world size 4."""

from __future__ import annotations

import json
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.distributed import ROOT, free_port, torchrun, wait_for_job
from tests.plans import make_plan

SCRIPT = ROOT / "tests" / "scripts" / "multinode_job.py"
NODES, PER_NODE, WORKERS = 2, 2, 2
WORLD = NODES * PER_NODE
# 60 = 3 steps of 16 + 12: a short last batch of 3 on every rank, and no padding, so the
# union over ranks must be exactly once
N, BATCH, EPOCHS, SEED = 60, 4, 2, 7
TIMEOUT = 180.0


def launch(tmp: Path, node: int, port: int) -> subprocess.Popen[bytes]:
    return torchrun(
        SCRIPT,
        "--out",
        tmp,
        "--samples",
        N,
        "--batch-size",
        BATCH,
        "--workers",
        WORKERS,
        "--epochs",
        EPOCHS,
        "--seed",
        SEED,
        nproc=PER_NODE,
        port=port,
        nnodes=NODES,
        node_rank=node,
    )


def run_job(tmp: Path) -> list[dict[str, Any]]:
    port = free_port()
    wait_for_job(tmp, [launch(tmp, node, port) for node in range(NODES)], TIMEOUT)
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_job(tmp_path_factory.mktemp("multinode"))


def plan_batches(rank: int, epoch: int) -> list[list[int]]:
    plan = make_plan(
        num_samples=N, world_size=WORLD, batch_size=BATCH, shuffle=True, seed=SEED, epoch=epoch
    )
    ids = plan.indices(plan.batches_positions(rank, range(plan.num_batches))).tolist()
    return [ids[i : i + BATCH] for i in range(0, len(ids), BATCH)]


def test_four_processes_on_two_nodes_each_with_two_workers(job: list[dict[str, Any]]) -> None:
    assert [r["rank"] for r in job] == list(range(WORLD))
    assert [r["dist_rank"] for r in job] == list(range(WORLD))
    assert {r["world_size"] for r in job} == {WORLD}
    assert [(r["node"], r["local_rank"]) for r in job] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    # the dataset resolved the global rank and world size, not the node-local ones
    assert [r["topology"] for r in job] == [[rank, WORLD] for rank in range(WORLD)]
    assert len({r["main_pid"] for r in job}) == WORLD
    for r in job:
        for e in r["epochs"]:
            # every batch read by one worker, batch b by worker b % 2, two worker processes
            assert all(len(w) == 1 for w in e["workers"])
            assert [w[0] for w in e["workers"]] == [b % WORKERS for b in range(len(e["workers"]))]
            pids = {p for ps in e["pids"] for p in ps}
            assert len(pids) == WORKERS and r["main_pid"] not in pids


def test_exactly_once_per_epoch_over_the_four_global_ranks(job: list[dict[str, Any]]) -> None:
    for epoch in range(EPOCHS):
        assert {r["epochs"][epoch]["num_padded"] for r in job} == {0}
        union = Counter(i for r in job for b in r["epochs"][epoch]["batches"] for i in b)
        assert union == Counter(range(N))
    # and the two epochs are shuffled differently
    assert job[0]["epochs"][0]["batches"] != job[0]["epochs"][1]["batches"]


def test_batch_counts_are_equal_on_every_rank(job: list[dict[str, Any]]) -> None:
    expected = -(-N // (WORLD * BATCH))
    for epoch in range(EPOCHS):
        counts = [len(r["epochs"][epoch]["batches"]) for r in job]
        assert counts == [expected] * WORLD
        assert {r["epochs"][epoch]["num_batches"] for r in job} == {expected}


def test_same_local_rank_on_different_nodes_gets_disjoint_data(
    job: list[dict[str, Any]],
) -> None:
    for epoch in range(EPOCHS):
        for local in range(PER_NODE):
            same = [r for r in job if r["local_rank"] == local]
            assert {r["node"] for r in same} == set(range(NODES))
            seen = [{i for b in r["epochs"][epoch]["batches"] for i in b} for r in same]
            assert seen[0] and seen[1] and not seen[0] & seen[1]


def test_each_rank_gets_the_pure_plans_batches_for_world_size_four(
    job: list[dict[str, Any]],
) -> None:
    for r in job:
        for epoch in range(EPOCHS):
            assert r["epochs"][epoch]["epoch"] == epoch
            expected = plan_batches(r["rank"], epoch)
            assert r["epochs"][epoch]["batches"] == expected
            assert [len(b) for b in expected] == [BATCH] * (len(expected) - 1) + [3]
