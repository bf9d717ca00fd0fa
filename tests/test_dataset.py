"""evenly.Dataset and evenly.DataLoader end to end, with real DataLoader worker processes.

Ranks are simulated here with explicit ``rank=``/``world_size=``; tests/test_ddp.py runs
real torch.distributed process groups.
"""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import numpy as np
import pytest
import torch
import torch.utils.data as tud

import evenly
from evenly import EvenlyWarning
from tests.plans import make_plan


def epoch_batches(loader: tud.DataLoader[Any]) -> list[list[int]]:
    return [batch.tolist() for batch in loader]


def run_ranks_inline(
    n: int, world: int, workers: int, batch: int, epochs: int = 1, **kwargs: Any
) -> list[list[list[list[int]]]]:
    """[rank][epoch] -> batches, each rank with its own dataset/loader (as in DDP)."""
    out = []
    for rank in range(world):
        ds = evenly.Dataset(list(range(n)), rank=rank, world_size=world, **kwargs)
        loader = evenly.DataLoader(ds, batch_size=batch, num_workers=workers)
        out.append([epoch_batches(loader) for _ in range(epochs)])
    return out


def map_style_batches(n: int, world: int, rank: int, batch: int, **plan: Any) -> list[list[int]]:
    """What a map-style DataLoader gives when its sampler yields this rank's plan."""
    p = make_plan(num_samples=n, world_size=world, batch_size=batch, **plan)
    sampler = p.indices(p.rank_positions(rank)).tolist()
    loader = tud.DataLoader(list(range(n)), batch_size=batch, sampler=sampler)
    return [b.tolist() for b in loader]


@pytest.mark.parametrize("workers", [0, 2, 3])
@pytest.mark.parametrize("world", [1, 2])
def test_exactly_once_equal_batches_and_map_style_sequence(workers: int, world: int) -> None:
    n, batch = 96, 8  # divisible: no padding
    ranks = run_ranks_inline(n, world, workers, batch, shuffle=True, seed=3)
    union = Counter(x for rank in ranks for b in rank[0] for x in b)
    assert union == Counter(range(n))
    assert len({len(rank[0]) for rank in ranks}) == 1
    for r, rank in enumerate(ranks):
        assert rank[0] == map_style_batches(n, world, r, batch, shuffle=True, seed=3)


@pytest.mark.parametrize("workers", [0, 2, 3])
def test_uneven_tail_is_padded_minimally_and_reported(workers: int) -> None:
    n, world, batch = 101, 3, 8
    with pytest.warns(EvenlyWarning, match="1 sample\\(s\\) repeated"):
        ranks = run_ranks_inline(n, world, workers, batch, shuffle=True)
    sizes = [[len(b) for b in rank[0]] for rank in ranks]
    assert sizes[0] == sizes[1] == sizes[2]
    assert sum(1 for s in sizes[0] if s < batch) == 1  # one partial batch per rank, last
    union = Counter(x for rank in ranks for b in rank[0] for x in b)
    assert set(union) == set(range(n)) and sum(union.values()) == n + 1


def test_drop_last_on_the_loader_wins_and_keeps_batches_full() -> None:
    ds = evenly.Dataset(list(range(50)), shuffle=True, rank=0, world_size=2)
    loader = evenly.DataLoader(ds, batch_size=4, num_workers=2, drop_last=True)
    batches = epoch_batches(loader)
    assert [len(b) for b in batches] == [4] * 6 and len(loader) == 6
    assert loader.plan.num_dropped == 2 and loader.plan.num_padded == 0
    # the loader's settings stay with the loader: the dataset's own passes (under any
    # other loader) keep the dataset's drop_last and are planned sample by sample
    assert len(ds) == 25


def test_epoch_advances_without_a_call_and_set_epoch_reproduces() -> None:
    ds = evenly.Dataset(list(range(64)), shuffle=True, seed=11)
    loader = evenly.DataLoader(ds, batch_size=8, num_workers=2)
    e0, e1, e2 = (epoch_batches(loader) for _ in range(3))
    assert e0 != e1 != e2 and e0 != e2
    assert all(sorted(x for b in e for x in b) == list(range(64)) for e in (e0, e1, e2))
    loader.set_epoch(1)
    assert epoch_batches(loader) == e1
    assert epoch_batches(loader) == e2  # automatic passes continue from there
    ds.set_epoch(0)  # the DistributedSampler habit works too
    assert loader.epoch == 0 and epoch_batches(loader) == e0


def test_persistent_workers_see_every_new_epoch() -> None:
    plain = evenly.DataLoader(evenly.Dataset(list(range(48)), shuffle=True), batch_size=6)
    expected = [epoch_batches(plain) for _ in range(3)]
    ds = evenly.Dataset(list(range(48)), shuffle=True)
    loader = evenly.DataLoader(ds, batch_size=6, num_workers=2, persistent_workers=True)
    assert [epoch_batches(loader) for _ in range(3)] == expected


def record_draws(x: int) -> tuple[int, float, float, float]:
    return x, random.random(), float(np.random.rand()), float(torch.rand(1))


def draws_by_position(world: int, workers: int, epochs: int = 2) -> dict[tuple[int, int], Any]:
    """(epoch, sample) -> the three draws made in the transform."""
    out = {}
    for rank in range(world):
        ds = evenly.Dataset(
            list(range(48)),
            shuffle=True,
            seed=5,
            transform=record_draws,
            rank=rank,
            world_size=world,
        )
        loader = evenly.DataLoader(ds, batch_size=4, num_workers=workers)
        for epoch in range(epochs):
            for batch in loader:
                for x, a, b, c in zip(*batch, strict=True):
                    out[(epoch, int(x))] = (float(a), float(b), float(c))
    return out


def test_per_sample_draws_are_distinct_and_independent_of_topology() -> None:
    reference = draws_by_position(world=1, workers=0)
    assert len(reference) == 96
    for stream in range(3):
        values = [v[stream] for v in reference.values()]
        assert len(set(values)) == len(values)  # across samples, workers, ranks, epochs
    for world, workers in [(1, 2), (1, 3), (2, 0), (2, 2), (2, 3)]:
        assert draws_by_position(world, workers) == reference


def test_the_users_rng_state_does_not_leak() -> None:
    ds = evenly.Dataset(list(range(20)), shuffle=True, transform=record_draws)
    # torch's DataLoader draws its workers' base seed from `generator` (else from the
    # global generator) when an iteration starts: give it its own, so only evenly could leak
    loader = evenly.DataLoader(ds, batch_size=4, num_workers=0, generator=torch.Generator())
    torch.manual_seed(123)
    random.seed(123)
    np.random.seed(123)
    expected = [(torch.rand(1).item(), random.random(), np.random.rand()) for _ in range(5)]
    torch.manual_seed(123)
    random.seed(123)
    np.random.seed(123)
    got = []
    for _ in loader:  # the training loop draws between batches
        got.append((torch.rand(1).item(), random.random(), np.random.rand()))
    assert got == expected


@pytest.mark.parametrize("workers", [0, 2])
def test_fewer_samples_than_ranks_times_workers(workers: int) -> None:
    world = 4
    with pytest.warns(EvenlyWarning) as caught:
        ranks = run_ranks_inline(3, world, workers, batch=2)
    messages = " ".join(str(w.message) for w in caught)
    assert "repeated so that each of the 4 rank(s) gets 1 samples" in messages
    if workers:
        assert "worker(s) idle" in messages
    assert [len(rank[0]) for rank in ranks] == [1] * world
    assert sorted(x for rank in ranks for b in rank[0] for x in b) == [0, 0, 1, 2]


@pytest.mark.parametrize("workers", [0, 2])
def test_empty_source_yields_no_batches_and_says_so(workers: int) -> None:
    ds = evenly.Dataset([], shuffle=True, rank=1, world_size=2)
    loader = evenly.DataLoader(ds, batch_size=4, num_workers=workers)
    with pytest.warns(EvenlyWarning, match="the source is empty"):
        assert epoch_batches(loader) == []
    assert len(loader) == 0 and len(ds) == 0


def test_plain_torch_dataloader_is_still_exactly_once() -> None:
    seen: Counter[int] = Counter()
    for rank in range(2):
        ds = evenly.Dataset(list(range(40)), shuffle=True, rank=rank, world_size=2)
        loader = tud.DataLoader(ds, batch_size=8, num_workers=2)
        ds.set_epoch(0)
        sizes = []
        for batch in loader:
            seen.update(batch.tolist())
            sizes.append(len(batch))
        assert sum(sizes) == len(ds) == 20
    assert seen == Counter(range(40))


@pytest.mark.parametrize(
    "source",
    [np.arange(30), tud.TensorDataset(torch.arange(30)), list(range(30))],
    ids=["numpy", "torch-map-style", "list"],
)
def test_any_sized_indexable_source(source: Any) -> None:
    ds = evenly.Dataset(source, shuffle=True)
    loader = evenly.DataLoader(ds, batch_size=5, num_workers=2)
    got = []
    for batch in loader:
        values = batch[0] if isinstance(batch, list) else batch
        got += [int(v) for v in values]
    assert sorted(got) == list(range(30))


def test_topology_comes_from_torchrun_variables_and_arguments_override(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    ds = evenly.Dataset(list(range(40)))
    assert ds.topology() == evenly.core.Topology(rank=3, world_size=4)
    assert len(ds) == 10
    assert evenly.Dataset([1], rank=0, world_size=1).topology() == evenly.core.Topology(0, 1)


def test_bad_arguments_say_what_is_wrong() -> None:
    with pytest.raises(TypeError, match="needs a source with __len__ and __getitem__"):
        evenly.Dataset(iter(range(3)))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rank 2 is out of range for world_size 2"):
        evenly.Dataset([1, 2], rank=2, world_size=2)
    with pytest.raises(TypeError, match="seed must be an integer"):
        evenly.Dataset([1, 2], seed="0")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"needs an evenly\.Dataset"):
        evenly.DataLoader(list(range(3)))  # type: ignore[arg-type]


def fail_on_seven(x: int) -> int:
    if x == 7:
        raise RuntimeError("bad sample")
    return x


@pytest.mark.parametrize("workers", [0, 2])
def test_a_failing_transform_names_the_sample(workers: int) -> None:
    ds = evenly.Dataset(list(range(16)), transform=fail_on_seven)
    loader = evenly.DataLoader(ds, batch_size=4, num_workers=workers)
    with pytest.raises(RuntimeError, match="bad sample") as info:
        epoch_batches(loader)
    text = str(info.value) + "".join(getattr(info.value, "__notes__", []))
    assert "sample 7 (position 7) of epoch 0, rank 0" in text


def test_a_hugging_face_dataset_is_a_source() -> None:
    import datasets

    hf = datasets.Dataset.from_dict({"idx": list(range(30)), "text": [f"t{i}" for i in range(30)]})
    ds = evenly.Dataset(hf, shuffle=True)
    loader = evenly.DataLoader(ds, batch_size=4, num_workers=2)
    got = [int(i) for batch in loader for i in batch["idx"]]
    assert sorted(got) == list(range(30)) and got != list(range(30))
