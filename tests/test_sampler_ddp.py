"""``evenly.BatchSampler`` in real processes: 2 gloo ranks with DataLoader workers, and
torchdata's ``StatefulDataLoader`` resuming in a fresh process."""

from __future__ import annotations

import warnings
from collections import Counter
from typing import Any

import pytest
import torch
import torch.distributed as dist

from evenly.loader.sampler import BatchSampler

from .distributed import in_fresh_process, run_ranks
from .test_sampler import Numbers as Indexed

pytestmark = pytest.mark.filterwarnings("ignore::evenly.EvenlyWarning")

N, BATCH, SEED = 1001, 10, 7


def _two_epochs(rank: int, world_size: int) -> dict[str, Any]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sampler = BatchSampler(N, BATCH, seed=SEED)  # rank and world size from the group
        loader = torch.utils.data.DataLoader(
            Indexed(N), batch_sampler=sampler, num_workers=2, persistent_workers=True
        )
        lens, epochs = [], []
        for _ in range(2):
            lens.append(len(loader))
            epochs.append([b.tolist() for b in loader])
    # a data-parallel group of this rank alone: a rank-local loader reads everything
    groups = [dist.new_group([r]) for r in range(world_size)]
    local = BatchSampler(N, BATCH, seed=SEED, process_group=groups[rank])
    local_samples = sorted(i for b in local for i in b)
    dist.barrier()  # rank 0 holds the store: it must not exit while rank 1 builds its group
    return {
        "lens": lens,
        "epochs": epochs,
        "warnings": [str(w.message) for w in caught],
        "local": local_samples,
    }


def test_two_gloo_ranks_with_workers_read_each_sample_once_per_epoch() -> None:
    results = run_ranks(_two_epochs, 2)
    for e in range(2):
        ranks = [r["epochs"][e] for r in results]
        # equal batch counts on both ranks, as len(loader) said before the epoch
        assert len(ranks[0]) == len(ranks[1]) == results[0]["lens"][e] == results[1]["lens"][e]
        assert len(ranks[0]) == 51
        # exactly once, but for the one reported repeat that evens out N = 1001
        seen = Counter(i for batches in ranks for b in batches for i in b)
        assert set(seen) == set(range(N))
        assert sum(seen.values()) == N + 1
        # the same batches as the plan gives ranks 0 and 1 of 2 in epoch e
        for rank, batches in enumerate(ranks):
            reference = BatchSampler(N, BATCH, seed=SEED, rank=rank, world_size=2)
            reference.set_epoch(e)
            assert batches == list(reference)
    # a new order in epoch 1, without set_epoch
    assert results[0]["epochs"][0] != results[0]["epochs"][1]
    for r in results:
        assert any("1 sample(s) repeated" in w for w in r["warnings"])
        assert r["local"] == list(range(N))


def _stateful_loader(num_workers: int) -> Any:
    from torchdata.stateful_dataloader import StatefulDataLoader  # type: ignore[import-untyped]

    sampler = BatchSampler(N, BATCH, seed=SEED, rank=1, world_size=2)
    return StatefulDataLoader(Indexed(N), batch_sampler=sampler, num_workers=num_workers)


def _interrupted(num_workers: int, k: int) -> dict[str, Any]:
    """Epoch 0 in full, then ``k`` batches of epoch 1; states after each."""
    warnings.simplefilter("ignore")
    loader = _stateful_loader(num_workers)
    epoch0 = [b.tolist() for b in loader]
    end_state = loader.state_dict()
    it = iter(loader)
    head = [next(it).tolist() for _ in range(k)]
    return {"epoch0": epoch0, "end": end_state, "head": head, "mid": loader.state_dict()}


def _resumed(num_workers: int, states: list[dict[str, Any]]) -> list[list[list[list[int]]]]:
    """For each state, a new loader that loads it and runs two passes."""
    warnings.simplefilter("ignore")
    out = []
    for state in states:
        loader = _stateful_loader(num_workers)
        loader.load_state_dict(state)
        out.append([[b.tolist() for b in loader] for _ in range(2)])
    return out


def test_stateful_dataloader_resumes_exactly_in_a_fresh_process() -> None:
    reference = BatchSampler(N, BATCH, seed=SEED, rank=1, world_size=2)
    expected = [list(reference) for _ in range(3)]
    k = 13
    for workers in (2, 0):
        run = in_fresh_process(_interrupted, workers, k)
        assert run["epoch0"] == expected[0]
        assert run["head"] == expected[1][:k]
        mid, end = in_fresh_process(_resumed, workers, [run["mid"], run["end"]])
        # mid-epoch: the rest of epoch 1 (workers had prefetched further), then epoch 2
        assert mid == [expected[1][k:], expected[2]]
        # saved between epochs: epoch 1 in full (not skipped), then epoch 2
        assert end == [expected[1], expected[2]]
