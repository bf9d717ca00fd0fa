"""A pass is fixed in the main process and reaches every worker: spawn/forkserver
workers read their rank's share, in_order=False is refused, changes between epochs are
clear errors, the plan agreement cannot hang, per-sample random streams are the
sample's own."""

from __future__ import annotations

import contextvars
import os
import warnings
from collections import Counter
from typing import Any

import numpy as np
import pytest
import torch
import torch.utils.data as tud

import evenly
from evenly.runtime.seeds import SeedSpreader
from tests.distributed import run_ranks

N = 37


def ids(batches: list[Any]) -> list[int]:
    return [int(x) for b in batches for x in (b if isinstance(b, list | torch.Tensor) else [b])]


# ---- 1. spawn / forkserver workers under DDP without RANK/WORLD_SIZE ----------------
def plain_loader_without_env(rank: int, world: int, context: str, evenly_loader: bool) -> Any:
    # the mp.spawn + init_process_group(rank=...) pattern: no torchrun variables
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        os.environ.pop(name, None)
    ds = evenly.Dataset(list(range(N)), shuffle=True, seed=1)
    loader: Any
    if evenly_loader:
        loader = evenly.DataLoader(ds, batch_size=4, num_workers=2, multiprocessing_context=context)
    else:
        loader = tud.DataLoader(ds, batch_size=4, num_workers=2, multiprocessing_context=context)
    epochs = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", evenly.EvenlyWarning)
        for _ in range(2):
            epochs.append(ids(list(loader)))
    return epochs


@pytest.mark.slow
@pytest.mark.parametrize("context", ["spawn", "forkserver"])
@pytest.mark.parametrize("evenly_loader", [False, True], ids=["torch-loader", "evenly-loader"])
def test_spawned_workers_read_their_ranks_share(context: str, evenly_loader: bool) -> None:
    ranks = run_ranks(plain_loader_without_env, 2, context, evenly_loader, timeout=240)
    for epoch in range(2):
        got = ranks[0][epoch] + ranks[1][epoch]
        counts = Counter(got)
        assert set(counts) == set(range(N)), "every sample delivered"
        assert sum(counts.values()) - N < 2, f"at most the reported padding: {counts}"
    # epochs advance by themselves under a plain DataLoader too
    assert ranks[0][0] != ranks[0][1]


# ---- 2. in_order=False ------------------------------------------------------------
def test_in_order_false_is_refused_at_construction() -> None:
    ds = evenly.Dataset(list(range(10)))
    with pytest.raises(ValueError, match="in_order=False"):
        evenly.DataLoader(ds, batch_size=2, num_workers=2, in_order=False)


# ---- 3. changes between epochs under persistent workers -----------------------------
def test_a_grown_source_under_persistent_plain_workers_is_a_clear_error() -> None:
    data = list(range(20))
    ds = evenly.Dataset(data, shuffle=True)
    loader = tud.DataLoader(ds, batch_size=4, num_workers=2, persistent_workers=True)
    assert sorted(ids(list(loader))) == list(range(20))
    data.extend(range(20, 30))
    ds.set_epoch(1)
    with pytest.raises(RuntimeError, match=r"the source changed .* len\(source\) is 20"):
        list(loader)


class Add:
    def __init__(self, offset: int) -> None:
        self.offset = offset

    def __call__(self, x: int) -> int:
        return x + self.offset


def test_evenly_loader_restarts_persistent_workers_after_a_change() -> None:
    data = list(range(20))
    ds = evenly.Dataset(data, shuffle=True, transform=Add(0))
    loader = evenly.DataLoader(ds, batch_size=4, num_workers=2)
    assert sorted(ids(list(loader))) == list(range(20))
    ds.transform = Add(1000)
    assert sorted(ids(list(loader))) == list(range(1000, 1020))
    data.extend(range(20, 30))
    with pytest.warns(evenly.EvenlyWarning, match="had 20 samples last epoch and has 30"):
        assert sorted(ids(list(loader))) == list(range(1000, 1030))


def test_an_error_when_a_pass_starts_reaches_the_main_process() -> None:
    """Raised before the first sample of a persistent worker's second pass: the message
    must arrive, not 'worker exited unexpectedly'."""
    data = list(range(12))
    ds = evenly.Dataset(data)
    loader = tud.DataLoader(ds, batch_size=3, num_workers=2, persistent_workers=True)
    list(loader)
    ds.source = list(range(12))  # replaced in the main process only
    ds.set_epoch(1)
    with pytest.raises(RuntimeError, match="replaced in the main process"):
        list(loader)


# ---- 4. the agreement cannot hang -----------------------------------------------------
def one_rank_unsplit(rank: int, world: int) -> str:
    kwargs = {} if rank == 0 else {"rank": 0, "world_size": 1}  # rank 1's bug
    ds = evenly.Dataset(list(range(40)), shuffle=True, **kwargs)  # type: ignore[arg-type]
    loader = evenly.DataLoader(ds, batch_size=4, agreement_timeout=3)
    try:
        for _ in loader:
            pass
    except evenly.PlanMismatchError as exc:
        return str(exc)
    return "trained alone"


@pytest.mark.slow
def test_a_rank_that_never_joins_makes_the_others_raise_naming_it() -> None:
    messages = run_ranks(one_rank_unsplit, 2, timeout=120)
    assert messages[1] == "trained alone"
    assert "rank(s) [1]" in messages[0] and "world_size=1" in messages[0]


def store_host_alone(rank: int, world: int) -> list[str]:
    """Rank 0, which hosts the store, built its loader with world_size=1 and trains alone
    (1 s a step, 10 steps); the others' loaders are split over the group.  Each of them
    times out (2 s), then waits again (60 s) until rank 0 finishes and exits."""
    import time

    import torch.distributed as dist

    dist.barrier()  # rank 0 is still training when the others look
    if rank == 0:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", evenly.EvenlyWarning)  # the world_size=1 warning
            ds = evenly.Dataset(list(range(10)), rank=0, world_size=1)
        for _ in evenly.DataLoader(ds, batch_size=1):
            time.sleep(1)
        return ["trained alone"]
    said = []
    for timeout in (2, 60):
        loader = evenly.DataLoader(evenly.Dataset(list(range(30))), agreement_timeout=timeout)
        try:
            next(iter(loader))
        except evenly.PlanMismatchError as exc:
            said.append(str(exc))
    return said


@pytest.mark.slow
def test_a_store_host_that_never_joins_is_named_by_every_other_rank() -> None:
    """Rank 0 (the store's host) built with world_size=1 under 3 real gloo ranks: ranks 1
    and 2 name it and why, both when their wait times out and when rank 0 exits and takes
    the store with it (not just "the store's host exited or crashed")."""
    ranks = run_ranks(store_host_alone, 3, timeout=180)
    assert ranks[0] == ["trained alone"]
    for said in ranks[1:]:
        assert len(said) == 2, said
        timed_out, lost = said
        assert "rank(s) [0]" in timed_out and "did not start epoch 0 within 2 s" in timed_out
        assert "rank(s) [0]" in lost and "never joined epoch 0" in lost
        for message in said:
            assert "world_size=1 in a process group of 3 rank(s)" in message, message
            assert "process_group=" in message


def evaluation_on_rank_zero(rank: int, world: int) -> dict[str, list[list[int]]]:
    """Two training epochs split over the group; after each, on rank 0 only, a pass of a
    rank-local evaluation loader (world_size=1, a short agreement timeout)."""
    train = evenly.DataLoader(evenly.Dataset(list(range(16)), shuffle=True), batch_size=4)
    local = evenly.Dataset(list(range(100, 106)), rank=0, world_size=1)
    evaluation = evenly.DataLoader(local, batch_size=4, agreement_timeout=2)
    out: dict[str, list[list[int]]] = {"train": [], "evaluation": []}
    for _ in range(2):
        out["train"].append(ids(list(train)))
        if rank == 0:
            out["evaluation"].append(ids(list(evaluation)))
    return out


@pytest.mark.slow
def test_a_rank_local_evaluation_loader_keeps_working() -> None:
    """A rank-local evaluation loader beside a training loader over 2 real gloo ranks:
    each of its passes reads the whole evaluation set on its rank, and training still
    reads every sample exactly once per epoch over the ranks, equally split."""
    ranks = run_ranks(evaluation_on_rank_zero, 2, timeout=120)
    assert ranks[0]["evaluation"] == [list(range(100, 106))] * 2
    assert ranks[1]["evaluation"] == []
    for epoch in range(2):
        per_rank = [r["train"][epoch] for r in ranks]
        assert [len(p) for p in per_rank] == [8, 8], epoch
        assert Counter(per_rank[0] + per_rank[1]) == Counter(range(16)), epoch
    assert ranks[0]["train"][0] != ranks[0]["train"][1]  # epoch 1 is the next epoch


# ---- 5. per-sample random streams -------------------------------------------------------
def test_numpy_gets_the_full_per_sample_seed() -> None:
    """With 32 bits, ~N**2/2**33 pairs of samples share all numpy draws (~10 here)."""
    n = 300_000
    seeds = evenly.core.EpochPlan(num_samples=n, seed=7).seeds(np.arange(n))
    spreader = SeedSpreader(("numpy",))
    spreader.prepare(seeds)
    draws = []
    for i in range(n):
        spreader.seed(i)
        draws.append(np.random.randint(0, 2**62))
    assert len(set(draws)) == n


def test_the_three_generators_get_unrelated_streams() -> None:
    import random

    seeds = evenly.core.EpochPlan(num_samples=100, seed=3).seeds(np.arange(100))
    spreader = SeedSpreader(("random", "numpy", "torch"))
    spreader.prepare(seeds)
    for i in range(100):
        spreader.seed(i)
        a, b, c = random.random(), float(np.random.random()), float(torch.rand(()))
        assert len({a, b, c}) == 3


def draws_of(seed_generators: tuple[str, ...]) -> list[tuple[float, float]]:
    def augment(x: int) -> tuple[float, float]:
        return float(np.random.random()), float(torch.rand(()))

    ds = evenly.Dataset(list(range(8)), transform=augment, seed_generators=seed_generators)
    return list(ds)


def test_seed_generators_names_what_is_seeded() -> None:
    np.random.seed(0)
    only_torch = draws_of(("torch",))
    np.random.seed(0)
    again = draws_of(("torch",))
    assert [t for _, t in only_torch] == [t for _, t in again]  # torch: per-sample seeds
    assert len({t for _, t in only_torch}) == 8
    # numpy was not seeded: its draws continue the global stream seeded above
    assert [n for n, _ in only_torch] == np.random.RandomState(0).random_sample(8).tolist()
    with pytest.raises(ValueError, match="unknown generator"):
        evenly.Dataset([1], seed_generators=("jax",))


def test_sample_seed_is_the_samples_own_and_only_inside_transforms() -> None:
    seen: list[int] = []

    def record(x: int) -> int:
        seen.append(evenly.sample_seed())
        return x

    ds = evenly.Dataset(list(range(5)), transform=record, seed_generators=(), seed=4)
    list(ds)
    assert seen == evenly.core.EpochPlan(num_samples=5, seed=4).seeds(np.arange(5)).tolist()
    with pytest.raises(RuntimeError, match="only available inside"):
        evenly.sample_seed()


def test_sample_seed_is_a_context_variable_reset_after_each_call() -> None:
    """Set and reset around each transform call (a contextvar, not a process global): a
    context copied inside the call keeps that sample's seed, and a transform that raises
    leaves no seed behind."""
    contexts: list[contextvars.Context] = []

    def keep(x: int) -> int:
        contexts.append(contextvars.copy_context())
        if x == 2:
            raise ValueError("boom")
        return x

    ds = evenly.Dataset(list(range(3)), transform=keep, seed_generators=(), seed=4)
    with pytest.raises(ValueError, match="boom"):
        list(ds)
    expected = evenly.core.EpochPlan(num_samples=3, seed=4).seeds(np.arange(3)).tolist()
    assert [c.run(evenly.sample_seed) for c in contexts] == expected
    with pytest.raises(RuntimeError, match="only available inside"):
        evenly.sample_seed()


# ---- 14. smaller holes --------------------------------------------------------------
def test_permutation_and_plan_take_any_shape() -> None:
    perm = evenly.core.FeistelPermutation(100, seed=0, epoch=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scalar = perm(5)
        grid = perm(np.arange(20).reshape(4, 5))
        plan = evenly.core.EpochPlan(num_samples=100, order=perm)
        assert plan.indices(7).shape == () and int(plan.indices(7)) == int(perm(7))
        assert plan.indices(np.arange(6).reshape(2, 3)).shape == (2, 3)
    assert scalar.shape == () and int(scalar) == int(perm([5])[0])
    assert grid.shape == (4, 5) and grid.ravel().tolist() == perm(np.arange(20)).tolist()
    with pytest.raises(TypeError, match="must be integers"):
        perm([1.5])


class FlakyOnce:
    """Index 5 fails on its first read only (a transient error); reads are counted."""

    def __init__(self) -> None:
        self.reads: Counter[int] = Counter()

    def __len__(self) -> int:
        return 12

    def __getitem__(self, index: int) -> int:
        self.reads[index] += 1
        if index == 5 and self.reads[index] == 1:
            raise OSError("transient")
        return index


def test_on_error_raise_never_rereads_a_failed_batch() -> None:
    source = FlakyOnce()
    loader = evenly.DataLoader(evenly.Dataset(source), batch_size=4)
    with pytest.raises(OSError, match="transient") as info:
        list(loader)
    assert max(source.reads.values()) == 1
    assert "sample 5 (position 5)" in "\n".join(getattr(info.value, "__notes__", []))


def test_a_transform_returning_none_names_the_sample() -> None:
    ds = evenly.Dataset(list(range(6)), transform=lambda x: None if x == 4 else x)
    with pytest.raises(TypeError, match="returned None for sample 4"):
        list(evenly.DataLoader(ds, batch_size=2))


def test_loader_epoch_is_the_running_pass_until_it_ends() -> None:
    loader = evenly.DataLoader(evenly.Dataset(list(range(8)), shuffle=True), batch_size=2)
    it = iter(loader)
    next(it)
    loader.set_epoch(5)
    assert loader.epoch == 0
    seen = [loader.epoch for _ in it]  # while the loop holds each batch, the last one too
    assert seen == [0, 0, 0]
    assert loader.epoch == 5
    assert next(iter(loader)) is not None and loader.epoch == 5


def test_public_names_are_sorted_and_exist() -> None:
    assert evenly.__all__ == sorted(evenly.__all__)
    for name in evenly.__all__:
        assert getattr(evenly, name) is not None
    assert issubclass(evenly.PlanMismatchError, RuntimeError)


def test_pickling_before_the_process_group_exists_fixes_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A copy made before torchrun's variables (or a process group) exist must not pin
    the dataset to rank 0 of 1 for later."""
    import pickle

    ds = evenly.Dataset(list(range(10)))
    pickle.dumps(ds)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert ds.topology() == evenly.core.Topology(1, 2)
    assert pickle.loads(pickle.dumps(ds)).topology() == evenly.core.Topology(1, 2)


def _store_host_leaves(rank: int, world: int) -> str:
    if rank == 0:
        return "left"  # the rank hosting the store (MASTER_ADDR) exits at once
    import time

    time.sleep(2)
    loader = evenly.DataLoader(evenly.Dataset(list(range(40))), batch_size=4)
    try:
        for _ in loader:
            pass
    except evenly.PlanMismatchError as exc:
        return str(exc)
    return "trained"


@pytest.mark.slow
def test_a_rank_left_without_the_store_host_gets_evenlys_message() -> None:
    """When the rank hosting the process group's store exits while another starts an
    epoch, that rank raises evenly's PlanMismatchError naming the cause, not torch's
    bare DistNetworkError."""
    left, message = run_ranks(_store_host_leaves, 2, timeout=120)
    assert left == "left"
    assert "lost the process group's store" in message and "rank 0" in message
