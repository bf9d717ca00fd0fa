"""The data-parallel group: under tensor/pipeline parallelism the ranks of one
model replica get identical batches and the split runs over the data-parallel group only."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch.distributed as dist

import evenly
from tests.distributed import run_ranks

N, BATCH = 101, 4


def tp_layout(rank: int, world: int, how: str, context: str) -> list[list[int]]:
    """4 ranks = 2 data-parallel x 2 tensor-parallel: replicas {0, 1} and {2, 3}."""
    if how == "mesh":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        group: Any = mesh["dp"]
    else:
        groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # every rank makes both
        group = groups[rank % 2]
    ds = evenly.Dataset(list(range(N)), shuffle=True, seed=2, process_group=group)
    loader = evenly.DataLoader(ds, batch_size=BATCH, num_workers=2, multiprocessing_context=context)
    out = []
    for _ in range(2):
        out.append([int(x) for batch in loader for x in batch])
        dist.barrier()
    return out


@pytest.mark.slow
@pytest.mark.parametrize(("how", "context"), [("mesh", "fork"), ("groups", "spawn")])
def test_replicas_get_identical_batches_and_disjoint_shares(how: str, context: str) -> None:
    ranks = run_ranks(tp_layout, 4, how, context, timeout=240)
    # replicas are {0, 1} (dp rank 0) and {2, 3}: DeviceMesh (2, 2) with dim 0 = dp, or
    # new_group([0, 2]) / ([1, 3]) (dp rank = rank // 2 as well)
    first, second = (0, 1), (2, 3)
    for epoch in range(2):
        assert ranks[first[0]][epoch] == ranks[first[1]][epoch]
        assert ranks[second[0]][epoch] == ranks[second[1]][epoch]
        both = Counter(ranks[first[0]][epoch] + ranks[second[0]][epoch])
        assert set(both) == set(range(N)) and sum(both.values()) == N + 1  # one pad
    assert ranks[0][0] != ranks[0][1]  # a new order each epoch


def outside_the_group(rank: int, world: int) -> str:
    group = dist.new_group([0])
    try:
        evenly.Dataset(list(range(4)), process_group=group)
    except ValueError as exc:
        return str(exc)
    return "ok"


@pytest.mark.slow
def test_a_rank_outside_the_given_group_is_told() -> None:
    messages = run_ranks(outside_the_group, 2, timeout=120)
    assert messages[0] == "ok"
    assert "not a member of the given group" in messages[1]


def _explicit_world_size_one(rank: int, world: int) -> tuple[list[str], list[str], int]:
    import warnings as w

    import torch.distributed as dist

    own = [dist.new_group([r]) for r in range(world)]  # every rank creates every group
    with w.catch_warnings(record=True) as caught:
        w.simplefilter("always")
        ds = evenly.Dataset(list(range(10)), rank=0, world_size=1)
        loader = evenly.DataLoader(ds, batch_size=5, agreement_timeout=None)
        first = [int(x) for b in loader for x in b]
        list(loader)  # a second epoch: still one warning
    loud = [str(c.message) for c in caught if issubclass(c.category, evenly.EvenlyWarning)]
    with w.catch_warnings(record=True) as caught:
        w.simplefilter("always")
        local = evenly.Dataset(list(range(10)), rank=0, world_size=1, process_group=own[rank])
        list(evenly.DataLoader(local, batch_size=5))
    quiet = [str(c.message) for c in caught if issubclass(c.category, evenly.EvenlyWarning)]
    return loud, quiet, len(first)


@pytest.mark.slow
def test_an_explicit_world_size_of_one_under_several_ranks_warns_once() -> None:
    """world_size=1 given while the default group has 2 ranks: every rank reads every
    sample, said once per dataset naming both sizes; a process_group of the rank's own
    (a rank-local loader on purpose) says nothing."""
    for rank, (loud, quiet, read) in enumerate(run_ranks(_explicit_world_size_one, 2)):
        assert len(loud) == 1, loud
        assert f"rank {rank} of 2" in loud[0] and "world_size=1" in loud[0]
        assert "process_group=" in loud[0]
        assert quiet == []
        assert read == 10
