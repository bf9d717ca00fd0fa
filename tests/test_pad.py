"""Exact evaluation: ``pad="none"`` (nothing repeated, nothing dropped, ranks at most one
batch apart, ``len()`` true per rank) and ``pad="mask"`` (equal batches, the repeats
recognisable in the transform), in the planning core, the loaders and checkpoints."""

from __future__ import annotations

import json
import warnings
from collections import Counter
from typing import Any

import numpy as np
import pytest
import torch
import torch.utils.data as tud
from hypothesis import given, settings
from hypothesis import strategies as st

import evenly
from evenly.core.plan import EpochPlan


@settings(max_examples=300, deadline=None)
@given(
    n=st.integers(0, 300),
    world=st.integers(1, 9),
    batch=st.integers(1, 7),
    start=st.integers(0, 300),
)
def test_pad_none_deals_every_remaining_position_once_and_ranks_stay_one_batch_apart(
    n: int, world: int, batch: int, start: int
) -> None:
    start = min(start, n)
    plan = EpochPlan(num_samples=n, world_size=world, batch_size=batch, start=start, pad="none")
    per_rank = [plan.rank_positions(r) for r in range(world)]
    got = np.sort(np.concatenate(per_rank)) if per_rank else np.array([])
    assert got.tolist() == list(range(start, n)), "each remaining position exactly once"
    assert plan.num_padded == 0
    batches = [plan.rank_batches(r) for r in range(world)]
    assert max(batches) - min(batches) <= 1
    assert batches[0] == max(batches) == plan.num_batches  # rank 0 has the most
    assert [len(p) for p in per_rank] == [plan.rank_samples(r) for r in range(world)]
    for r in range(world):  # every batch is a prefix-consistent step, the last may be short
        sizes = [len(plan.batch_positions(r, b)) for b in range(plan.rank_batches(r))]
        assert all(s == batch for s in sizes[:-1]) and all(0 < s <= batch for s in sizes)
    repeat = EpochPlan(num_samples=n, world_size=world, batch_size=batch, start=start)
    assert plan.consumed_after(plan.num_batches) == repeat.end == n


def ids(batches: list[Any]) -> list[int]:
    return [int(x) for b in batches for x in b]


@pytest.mark.parametrize("workers", [0, 2])
def test_pad_none_under_simulated_ranks_reads_every_sample_once(workers: int) -> None:
    n, world = 301, 4
    loaders = [
        evenly.DataLoader(
            evenly.Dataset(
                list(range(n)), shuffle=True, seed=5, rank=r, world_size=world, pad="none"
            ),
            batch_size=8,
            num_workers=workers,
        )
        for r in range(world)
    ]
    for _ in range(2):  # two epochs
        lengths = [len(ld) for ld in loaders]
        got = [list(ld) for ld in loaders]
        assert [len(g) for g in got] == lengths, "len() is true per rank"
        assert max(lengths) - min(lengths) <= 1
        assert Counter(x for g in got for x in ids(g)) == Counter(range(n))


def test_pad_none_resumes_exactly_and_states_name_the_pad_mode() -> None:
    def loader(world: int, rank: int, pad: str = "none", batch: int = 8) -> evenly.DataLoader:
        ds = evenly.Dataset(
            list(range(101)), shuffle=True, seed=2, rank=rank, world_size=world, pad=pad
        )
        return evenly.DataLoader(ds, batch_size=batch)

    first = [loader(3, r) for r in range(3)]
    its = [iter(ld) for ld in first]
    head = [x for it in its for _ in range(2) for x in next(it).tolist()]
    state = json.loads(json.dumps(first[0].state_dict()))
    assert state["version"] == 3 and state["pad"] == "none"
    rest = []
    for r in range(2):  # resumed on 2 ranks with another batch size
        resumed = loader(2, r, batch=5)
        resumed.load_state_dict(state)
        rest += ids(list(resumed))
    assert Counter(head + rest) == Counter(range(101))
    with pytest.raises(evenly.StateError, match="pad: saved 'none', dataset has 'repeat'"):
        loader(3, 0, pad="repeat").load_state_dict(state)


def test_a_version_2_state_loads_as_pad_repeat() -> None:
    ds = evenly.Dataset(list(range(10)))
    v2 = {
        "format": "evenly.state",
        "version": 2,
        "epoch": 1,
        "position": 4,
        "batches": 2,
        "num_samples": 10,
        "seed": 0,
        "shuffle": "none",
        "drop_last": False,
    }
    loader = evenly.DataLoader(ds, batch_size=2)
    loader.load_state_dict(v2)
    assert (loader.epoch, next(iter(loader)).tolist()) == (1, [4, 5])
    with pytest.raises(evenly.StateError, match="pad"):
        evenly.DataLoader(evenly.Dataset(list(range(10)), pad="none")).load_state_dict(v2)


def test_batch_sampler_pad_none_is_exact_and_mask_is_refused() -> None:
    data = list(range(23))
    got = []
    for r in range(3):
        sampler = evenly.BatchSampler(23, 4, seed=1, rank=r, world_size=3, pad="none")
        batches = [b.tolist() for b in tud.DataLoader(data, batch_sampler=sampler)]
        assert len(batches) == len(sampler)
        got += [x for b in batches for x in b]
    assert sorted(got) == data
    with pytest.raises(ValueError, match="pad must be 'repeat' or 'none'"):
        evenly.BatchSampler(23, 4, pad="mask")


def test_pad_mask_needs_a_transform_naming_is_padding() -> None:
    with pytest.raises(ValueError, match=r"pad='mask' needs a transform.*is_padding"):
        evenly.Dataset(list(range(5)), pad="mask")
    ds = evenly.Dataset(list(range(5)), pad="mask", transform=lambda x: x)
    with pytest.raises(ValueError, match="pad='mask' needs a transform"):
        ds.transform = None
    with pytest.raises(RuntimeError, match="only available inside"):
        evenly.is_padding()


def _marked(x: int) -> dict[str, Any]:
    return {"x": x, "pad": evenly.is_padding()}


@pytest.mark.parametrize("workers", [0, 2])
def test_pad_mask_keeps_batches_equal_and_marks_exactly_the_repeats(workers: int) -> None:
    n, world = 101, 4  # 101 = 4 * 25 + 1: 3 repeats
    per_rank = []
    for r in range(world):
        ds = evenly.Dataset(
            list(range(n)),
            shuffle=True,
            seed=3,
            rank=r,
            world_size=world,
            pad="mask",
            transform=_marked,
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", evenly.EvenlyWarning)
            per_rank.append(list(evenly.DataLoader(ds, batch_size=6, num_workers=workers)))
    assert len({len(b) for b in per_rank}) == 1, "every rank the same batches"
    real = [
        int(x)
        for b in per_rank
        for batch in b
        for x, p in zip(batch["x"], batch["pad"], strict=True)
        if not p
    ]
    pads = sum(int(p) for b in per_rank for batch in b for p in batch["pad"])
    assert sorted(real) == list(range(n)) and pads == 3


def _metric_rank(rank: int, world: int, pad: str) -> float:
    import torchmetrics

    def label(x: int) -> dict[str, Any]:
        return {"x": x, "keep": not evenly.is_padding()}

    kw: dict[str, Any] = {"transform": label} if pad == "mask" else {}
    ds = evenly.Dataset(list(range(1, 102)), pad=pad, **kw)  # 101 samples, 2 ranks
    metric = torchmetrics.MeanMetric()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", evenly.EvenlyWarning)
        for batch in evenly.DataLoader(ds, batch_size=8, num_workers=2):
            if pad == "mask":
                values = batch["x"].float()
                metric.update(values, weight=batch["keep"].float())
            else:
                metric.update(batch.float())
    return float(metric.compute())  # synced over the 2 gloo ranks


@pytest.mark.slow
@pytest.mark.parametrize("pad", ["none", "mask"])
def test_a_metric_synced_over_two_gloo_ranks_equals_the_one_process_value(pad: str) -> None:
    """torchmetrics' MeanMetric over N = 101 samples on 2 real ranks (2 workers each):
    with pad="none" (ranks 51 and 50 samples) or pad="mask" (the repeat weighted 0) the
    synced mean is the mean of 1..101, as in one process (the default pad counts the
    repeated sample twice)."""
    from tests.distributed import run_ranks

    results = run_ranks(_metric_rank, 2, pad, timeout=240)
    assert results[0] == results[1] == pytest.approx(51.0)
    assert float(torch.arange(1, 102).float().mean()) == pytest.approx(51.0)


def _uneven_warnings(rank: int, world: int) -> list[list[str]]:
    """Each rank's EvenlyWarnings over one pass of pad="none" (11 samples, batch 1: the
    ranks get 6 and 5 batches) under an evenly.DataLoader (2 workers) and a BatchSampler,
    and over one pass of the same plan with pad="mask" (equal batches)."""
    loaders: list[Any] = [
        evenly.DataLoader(evenly.Dataset(list(range(11)), pad="none"), num_workers=2),
        tud.DataLoader(list(range(11)), batch_sampler=evenly.BatchSampler(11, 1, pad="none")),
        evenly.DataLoader(
            evenly.Dataset(list(range(11)), pad="mask", transform=lambda x: x), num_workers=2
        ),
    ]
    out = []
    for loader in loaders:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            list(loader)
        out.append([str(w.message) for w in caught if issubclass(w.category, evenly.EvenlyWarning)])
    return out


@pytest.mark.slow
def test_pad_none_with_uneven_batch_counts_warns_at_the_pass_start_on_every_rank() -> None:
    """A per-step collective over pad="none" hangs or fails in gloo on the rank with one
    batch more: every rank is told, once, at the pass start, with the counts per rank
    and the pad mode that keeps them equal; pad="mask" (equal counts) says nothing of it."""
    from tests.distributed import run_ranks

    ranks = run_ranks(_uneven_warnings, 2, timeout=240)
    for rank in ranks:
        for said in rank[:2]:  # evenly.DataLoader, BatchSampler
            uneven = [m for m in said if "different batch counts" in m]
            assert len(uneven) == 1, said
            assert "rank 0: 6, rank 1: 5 batches" in uneven[0] and "pad='mask'" in uneven[0]
        assert not any("different batch counts" in m for m in rank[2]), rank[2]
