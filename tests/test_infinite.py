"""Training by steps: ``evenly.DataLoader(..., infinite=True)`` runs
across epochs without the loop restarting ``iter()``; every batch is full, every epoch
is still read exactly once, and a state resumes exactly by step under another topology."""

from __future__ import annotations

import json
from typing import Any

import pytest

import evenly

N, BATCH = 37, 4


def loaders(world: int, workers: int, **kw: Any) -> list[evenly.DataLoader]:
    return [
        evenly.DataLoader(
            evenly.Dataset(list(range(N)), shuffle=True, seed=5, rank=r, world_size=world),
            batch_size=BATCH,
            num_workers=workers,
            infinite=True,
            **kw,
        )
        for r in range(world)
    ]


def steps(loader: Any, k: int) -> list[list[int]]:
    it = iter(loader)
    return [next(it).tolist() for _ in range(k)]


def stream_of(per_rank: list[list[list[int]]]) -> list[int]:
    """Interleave ranks step by step: the order all ranks consumed together."""
    return [x for s in zip(*per_rank, strict=True) for b in s for x in b]


@pytest.mark.parametrize("workers", [0, 2])
def test_full_batches_across_epochs_each_epoch_exactly_once(workers: int) -> None:
    k = 3 * N // (2 * BATCH) + 1  # a bit more than three epochs on 2 ranks
    per_rank = [steps(loader, k) for loader in loaders(2, workers)]
    assert all(len(b) == BATCH for r in per_rank for b in r)  # every batch full
    stream = stream_of(per_rank)
    for e in range(3):
        assert sorted(stream[e * N : (e + 1) * N]) == list(range(N)), f"epoch {e}"
    assert stream[:N] != stream[N : 2 * N]  # a new order each epoch
    # the same order an epoch-by-epoch loader gives
    plain = evenly.DataLoader(evenly.Dataset(list(range(N)), shuffle=True, seed=5), batch_size=N)
    assert stream[:N] == next(iter(plain)).tolist()


def test_a_new_iter_continues_where_the_loop_stopped_and_len_is_undefined() -> None:
    (loader,) = loaders(1, 0)
    a = steps(loader, 5)
    b = steps(loader, 5)
    joined = [x for batch in a + b for x in batch]
    assert sorted(joined[:N]) == list(range(N)) and len(set(joined[N:])) == len(joined) - N
    with pytest.raises(TypeError, match="has no length"):
        len(loader)
    loader.set_epoch(0)  # replay from the start of epoch 0
    assert steps(loader, 5) == a


def _ddp_steps(
    rank: int, world: int, context: str, k: int, state: dict[str, Any] | None
) -> tuple[list[list[int]], dict[str, Any]]:
    """In a real gloo rank: an infinite loader (rank and world size from the process
    group) with workers started by ``context``; ``k`` steps, then its state."""
    ds = evenly.Dataset(list(range(N)), shuffle=True, seed=5)
    loader = evenly.DataLoader(
        ds, batch_size=BATCH, num_workers=2, infinite=True, multiprocessing_context=context
    )
    if state is not None:
        loader.load_state_dict(state)
    return steps(loader, k), json.loads(json.dumps(loader.state_dict()))


@pytest.mark.slow
def test_infinite_under_real_ddp_ranks_with_spawned_workers_resumes_by_step() -> None:
    from tests.distributed import run_ranks

    first = run_ranks(_ddp_steps, 2, "spawn", 7, None)
    states = [s for _, s in first]
    assert states[0] == states[1] and (states[0]["epoch"], states[0]["position"]) == (1, 19)
    # a fresh run (forkserver workers) continues by step from the saved state
    second = run_ranks(_ddp_steps, 2, "forkserver", 7, states[0])
    per_rank = [b for b, _ in first], [b for b, _ in second]
    assert all(len(b) == BATCH for part in per_rank for r in part for b in r)
    stream = stream_of(per_rank[0]) + stream_of(per_rank[1])  # 112 positions
    for e in range(3):
        assert sorted(stream[e * N : (e + 1) * N]) == list(range(N)), f"epoch {e}"
    # the same stream a single uninterrupted 2-rank run gives
    whole = [steps(loader, 14) for loader in loaders(2, 0)]
    assert stream == stream_of(whole)


def test_state_after_set_epoch_is_where_the_next_pass_starts() -> None:
    (loader,) = loaders(1, 0)
    steps(loader, 12)  # 48 positions: epoch 1, position 11
    assert (loader.state_dict()["epoch"], loader.state_dict()["position"]) == (1, 11)
    loader.set_epoch(5)
    state = json.loads(json.dumps(loader.state_dict()))
    assert (state["epoch"], state["position"]) == (5, 0)
    (fresh,) = loaders(1, 0)
    fresh.load_state_dict(state)
    (replayed,) = loaders(1, 0)
    replayed.set_epoch(5)
    assert steps(fresh, 3) == steps(replayed, 3) == steps(loader, 3)


def test_a_mixture_is_refused_rather_than_streamed() -> None:
    mix = evenly.Mix({"a": list(range(10)), "b": list(range(100, 104))}, weights={"a": 1, "b": 1})
    with pytest.raises(ValueError, match="does not support a Mix source"):
        evenly.DataLoader(evenly.Dataset(mix), batch_size=4, infinite=True)
    ds = evenly.Dataset(list(range(8)))
    loader = evenly.DataLoader(ds, batch_size=4, infinite=True)
    ds.source = mix  # set after the loader was built: refused at the pass start
    with pytest.raises(ValueError, match="does not support a Mix source"):
        iter(loader)
