"""Exact, elastic mid-epoch resume: save after k batches, resume in a fresh process under
another topology, and compare with the uninterrupted run."""

from __future__ import annotations

import json
import warnings
from collections import Counter
from typing import Any

import numpy as np
import pytest

import evenly
from evenly import StateError
from tests.distributed import in_fresh_process, run_ranks
from tests.plans import make_plan

N = 120


def loaders(world: int, workers: int, batch: int, **kw: Any) -> list[evenly.DataLoader]:
    """One loader per rank, as each DDP rank would build it."""
    return [
        evenly.DataLoader(
            evenly.Dataset(list(range(N)), shuffle=True, seed=4, rank=r, world_size=world),
            batch_size=batch,
            num_workers=workers,
            **kw,
        )
        for r in range(world)
    ]


def first_part(
    world: int, workers: int, batch: int, k: int
) -> tuple[list[dict[str, Any]], list[int]]:
    """Every rank receives k batches of epoch 0; returns each rank's state and the ids."""
    states, ids = [], []
    for loader in loaders(world, workers, batch):
        it = iter(loader)
        for _ in range(k):
            ids += next(it).tolist()
        states.append(json.loads(json.dumps(loader.state_dict())))
        del it
    return states, ids


def second_part(state: dict[str, Any], world: int, workers: int, batch: int) -> dict[str, Any]:
    """A fresh loader per rank loads the state: the resumed pass, then the next epoch."""
    resumed, following = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", evenly.EvenlyWarning)
        for loader in loaders(world, workers, batch):
            loader.load_state_dict(state)
            length = loader.remaining_batches
            # len() counts what the interrupted run received in this epoch (Lightning's
            # and StatefulDataLoader's convention) plus what is left
            assert len(loader) == state["batches"] + length
            resumed.append([b.tolist() for b in loader])
            assert len(resumed[-1]) == length
            following.append([b.tolist() for b in loader])
            padded = loader.plan.num_padded
    return {"resumed": resumed, "following": following, "padded": padded}


def order(epoch: int) -> list[int]:
    plan = make_plan(num_samples=N, shuffle=True, seed=4, epoch=epoch)
    return plan.indices(np.arange(N)).tolist()


CASES = {
    "workers-0-to-3": ((1, 0, 8), (1, 3, 8)),
    "workers-4-to-1": ((1, 4, 8), (1, 1, 8)),
    "world-2-to-3": ((2, 2, 4), (3, 2, 4)),
    "world-4-to-1": ((4, 1, 4), (1, 0, 4)),
    "batch-4-to-7": ((2, 2, 4), (2, 2, 7)),
    "same-topology": ((1, 2, 8), (1, 2, 8)),
}
K = 3


def second_parts(jobs: list[tuple[dict[str, Any], tuple[int, int, int]]]) -> list[dict[str, Any]]:
    return [second_part(state, *after) for state, after in jobs]


@pytest.fixture(scope="module")
def resumed() -> dict[str, tuple[dict[str, Any], list[int], dict[str, Any]]]:
    """Save after K batches under each 'before'; resume all 'after's in ONE fresh process."""
    firsts = {name: first_part(*before, K) for name, (before, _) in CASES.items()}
    jobs = [(firsts[name][0][0], after) for name, (_, after) in CASES.items()]
    outs = in_fresh_process(second_parts, jobs)
    return {
        name: (firsts[name][0], firsts[name][1], out) for name, out in zip(CASES, outs, strict=True)
    }


@pytest.mark.parametrize("case", list(CASES))
def test_resume_in_a_fresh_process_under_a_new_topology(
    case: str, resumed: dict[str, tuple[list[dict[str, Any]], list[int], dict[str, Any]]]
) -> None:
    (world_b, _, batch_b), (world, _, batch) = CASES[case]
    states, seen, out = resumed[case]
    assert all(s == states[0] for s in states)  # the same state on every rank
    state = states[0]
    assert (state["epoch"], state["position"]) == (0, K * world_b * batch_b)
    resumed_batches = out["resumed"]
    # equal batch counts on the new ranks
    assert len({len(r) for r in resumed_batches}) == 1
    # union before + after = exactly one epoch, up to the reported pad
    union = Counter(seen + [x for r in resumed_batches for b in r for x in b])
    assert set(union) == set(range(N))
    assert sum(union.values()) == N + out["padded"] and out["padded"] < world
    # what was consumed first is the prefix of epoch 0's order; the rest follows in order
    full = order(0)
    assert sorted(seen) == sorted(full[: state["position"]])
    steps = min(len(b) for b in resumed_batches)
    flat = [x for s in range(steps) for r in resumed_batches if len(r[s]) == batch for x in r[s]]
    assert flat == full[state["position"] : state["position"] + len(flat)]
    # the epoch after the resumed one is the normal epoch 1
    following = [x for r in out["following"] for b in r for x in b]
    assert sorted(following) == sorted(order(1))  # N divides evenly: no pad in epoch 1
    assert out["following"][0][0] == order(1)[:batch]


def test_same_topology_resume_gives_exactly_the_uninterrupted_batches(
    resumed: dict[str, tuple[list[dict[str, Any]], list[int], dict[str, Any]]],
) -> None:
    (uninterrupted,) = loaders(1, 2, 8)
    expected = [b.tolist() for b in uninterrupted] + [b.tolist() for b in uninterrupted]
    _, _, out = resumed["same-topology"]
    assert out["resumed"][0] + out["following"][0] == expected[K:]


def test_prefetched_batches_are_not_counted() -> None:
    (loader,) = loaders(1, 2, 4, prefetch_factor=4)
    it = iter(loader)
    next(it)
    next(it)
    assert loader.state_dict()["position"] == 8


def test_resume_twice_in_one_epoch_and_state_after_a_pass() -> None:
    (loader,) = loaders(1, 0, 10)
    received = []
    it = iter(loader)
    for _ in range(3):
        received += next(it).tolist()
    state = loader.state_dict()
    (second,) = loaders(1, 2, 6)
    second.load_state_dict(state)
    it = iter(second)
    for _ in range(4):
        received += next(it).tolist()
    state = second.state_dict()
    assert state["position"] == 30 + 24
    (third,) = loaders(1, 3, 5)
    third.load_state_dict(state)
    received += [x for b in third for x in b.tolist()]
    assert received == order(0)
    assert third.state_dict()["epoch"] == 1 and third.state_dict()["position"] == 0


def test_load_into_a_loader_with_persistent_workers_running() -> None:
    (loader,) = loaders(1, 2, 8, persistent_workers=True)
    epoch0 = [x for b in loader for x in b.tolist()]
    assert epoch0 == order(0)
    it = iter(loader)  # epoch 1
    part = next(it).tolist() + next(it).tolist()
    state = loader.state_dict()
    assert (state["epoch"], state["position"]) == (1, 16)
    loader.load_state_dict(state)
    rest = [x for b in loader for x in b.tolist()]
    assert part + rest == order(1)


def test_a_ddp_resume_from_2_to_3_real_ranks() -> None:
    saved = run_ranks(ddp_first_part, 2, env={"PYTHONWARNINGS": "ignore"})
    assert saved[0]["state"] == saved[1]["state"]
    resumed = run_ranks(ddp_second_part, 3, saved[0]["state"], env={"PYTHONWARNINGS": "ignore"})
    counts = {len(r) for r in resumed}
    assert len(counts) == 1
    union = Counter(
        [x for s in saved for x in s["ids"]] + [x for r in resumed for b in r for x in b]
    )
    assert set(union) == set(range(N)) and sum(union.values()) - N < 3


def ddp_first_part(rank: int, world: int) -> dict[str, Any]:
    ds = evenly.Dataset(list(range(N)), shuffle=True, seed=4)
    loader = evenly.DataLoader(ds, batch_size=4, num_workers=2)
    it = iter(loader)
    ids = [x for _ in range(5) for x in next(it).tolist()]
    return {"state": loader.state_dict(), "ids": ids}


def ddp_second_part(rank: int, world: int, state: dict[str, Any]) -> list[list[int]]:
    ds = evenly.Dataset(list(range(N)), shuffle=True, seed=4)
    loader = evenly.DataLoader(ds, batch_size=4, num_workers=2)
    loader.load_state_dict(state)
    return [b.tolist() for b in loader]


def test_a_mismatched_state_names_each_difference() -> None:
    (loader,) = loaders(1, 0, 4)
    state = loader.state_dict()
    other = evenly.DataLoader(evenly.Dataset(list(range(N + 1)), shuffle=False, seed=5))
    with pytest.raises(StateError) as info:
        other.load_state_dict(state)
    message = str(info.value)
    assert "num_samples: saved 120, dataset has 121" in message
    assert "seed: saved 4, dataset has 5" in message
    assert "shuffle: saved 'global', dataset has 'none'" in message
    assert "drop_last" not in message
    with pytest.raises(StateError, match="unknown evenly state version 99"):
        loader.load_state_dict({**state, "version": 99})
    with pytest.raises(StateError, match="not an evenly state dict"):
        loader.load_state_dict({"epoch": 1})


def test_plain_dataloader_users_resume_through_the_dataset() -> None:
    import torch.utils.data as tud

    ds = evenly.Dataset(list(range(N)), shuffle=True, seed=4)
    loader = tud.DataLoader(ds, batch_size=8, num_workers=0)
    it = iter(loader)
    got = next(it).tolist() + next(it).tolist()
    state = ds.state_dict()
    assert state["position"] == 16
    fresh = evenly.Dataset(list(range(N)), shuffle=True, seed=4)
    fresh.load_state_dict(state)
    got += [x for b in tud.DataLoader(fresh, batch_size=8, num_workers=2) for x in b.tolist()]
    assert sorted(got) == list(range(N)) and got[:16] == order(0)[:16]


def mixture() -> evenly.Mix:
    return evenly.Mix(
        {"a": list(range(N - 20)), "b": list(range(N - 20, N))}, weights={"a": 3, "b": 1}
    )


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("kind", ["list", "mix"])
def test_works_under_torchdata_stateful_dataloader(workers: int, kind: str) -> None:
    from torchdata.stateful_dataloader import StatefulDataLoader

    def make() -> StatefulDataLoader:
        source: Any = list(range(N)) if kind == "list" else mixture()
        ds = evenly.Dataset(source, shuffle=True, seed=4)
        return StatefulDataLoader(ds, batch_size=8, num_workers=workers)

    first = make()
    it = iter(first)
    got = [x for _ in range(5) for x in next(it).tolist()]
    state = first.state_dict()
    del it
    second = make()
    second.load_state_dict(state)
    rest = [x for b in second for x in b.tolist()]
    epoch = [x for b in make() for x in b.tolist()]  # a whole epoch 0, uninterrupted
    assert Counter(got + rest) == Counter(epoch)  # exactly once, no fast-forward replay
    if kind == "list":
        assert Counter(epoch) == Counter(range(N))


def stateful_resume_then_next_epoch(workers: int, state: dict[str, Any]) -> list[list[int]]:
    """A new StatefulDataLoader over a new dataset loads ``state``: the rest of the epoch,
    then the next one."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    ds = evenly.Dataset(list(range(N)), shuffle=True, seed=4)
    loader = StatefulDataLoader(ds, batch_size=8, num_workers=workers)
    loader.load_state_dict(state)
    return [[x for b in loader for x in b.tolist()] for _ in range(2)]


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")
@pytest.mark.parametrize("workers", [0, 2])
def test_stateful_dataloader_continues_with_the_next_epochs_after_a_resume(workers: int) -> None:
    from torchdata.stateful_dataloader import StatefulDataLoader

    first = StatefulDataLoader(
        evenly.Dataset(list(range(N)), shuffle=True, seed=4), batch_size=8, num_workers=workers
    )
    it = iter(first)
    got = [x for _ in range(3) for x in next(it).tolist()]
    state = first.state_dict()
    del it
    del first
    rest, following = stateful_resume_then_next_epoch(workers, state)
    assert Counter(got + rest) == Counter(range(N))
    assert sorted(following) == list(range(N))
    assert following != got + rest  # epoch 1, not epoch 0 again
    if workers == 0:
        assert following == order(1)
