"""evenly.Mix through evenly.Dataset and evenly.DataLoader (real worker processes; ranks
simulated with rank=/world_size=): exact counts per source and epoch, every sample of a
source once before any twice, prefix exactness at global step boundaries, equal batches,
exact resume under other ranks/workers, and weight changes at an epoch boundary."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import evenly
from evenly.core.spec import PassSpec
from evenly.mixture import Mix

LENGTHS = {"web": 23, "code": 7, "books": 1}  # books: shorter than its share, length 1
WEIGHTS = {"web": 5.0, "code": 3.0, "books": 2.0}
Epochs = list[list[list[list[int]]]]  # epoch -> rank -> batch -> sample ids


def sources(lengths: dict[str, int] = LENGTHS) -> dict[str, list[int]]:
    """Sample ``i`` of the ``d``-th source is the id ``1000 * d + i``."""
    return {
        name: list(range(1000 * d, 1000 * d + n)) for d, (name, n) in enumerate(lengths.items())
    }


def make_mix(**kw: Any) -> Mix:
    kw.setdefault("weights", WEIGHTS)
    kw.setdefault("samples_per_epoch", 40)
    return Mix(sources(kw.pop("lengths", LENGTHS)), **kw)


def loaders(
    make: Callable[[], Mix], world: int, batch: int, workers: int, shuffle: bool = True, **kw: Any
) -> list[evenly.DataLoader]:
    """One loader per simulated rank, each over its own Mix (as each DDP rank builds it)."""
    return [
        evenly.DataLoader(
            evenly.Dataset(make(), shuffle=shuffle, seed=7, rank=r, world_size=world),
            batch_size=batch,
            num_workers=workers,
            **kw,
        )
        for r in range(world)
    ]


def run(lds: Sequence[evenly.DataLoader], epochs: int) -> Epochs:
    return [[[b.tolist() for b in loader] for loader in lds] for _ in range(epochs)]


def steps(epoch: list[list[list[int]]]) -> list[list[int]]:
    """The epoch's global steps: batch k of every rank, in rank order."""
    return [[x for rank in epoch for x in rank[k]] for k in range(len(epoch[0]))]


def per_source(ids: Sequence[int]) -> list[int]:
    return np.bincount(np.asarray(ids, dtype=np.int64) // 1000, minlength=len(LENGTHS)).tolist()


def assert_once_before_twice(ids: Sequence[int], lengths: dict[str, int] = LENGTHS) -> None:
    """Every source's samples have been read m or m + 1 times (m = reads // length)."""
    seen = Counter(ids)
    for d, n in enumerate(lengths.values()):
        times = [seen[1000 * d + i] for i in range(n)]
        assert max(times) - min(times) <= 1, (d, times)


# ---- epochs ------------------------------------------------------------------------------


def test_epochs_are_exact_per_source_once_before_twice_and_exact_at_every_step() -> None:
    mix = make_mix()
    counts = list(mix.counts.values())
    assert counts == [20, 12, 8] and len(mix) == 40
    bounds = list(mix.bounds(8).values())
    lds = loaders(make_mix, world=2, batch=4, workers=2)
    epochs = run(lds, 3)
    history: list[int] = []
    for epoch in epochs:
        assert [len(rank) for rank in epoch] == [len(lds[0])] * 2 == [5, 5]
        ids = [x for rank in epoch for batch in rank for x in batch]
        assert per_source(ids) == counts
        prefix: list[int] = []
        for step in steps(epoch):
            prefix += step
            dev = np.abs(np.array(per_source(prefix)) - len(prefix) * np.array(counts) / 40)
            assert (dev <= np.array(bounds) + 1e-9).all(), (len(prefix), per_source(prefix))
            assert_once_before_twice(history + prefix)
        history += prefix
    assert epochs[0] != epochs[1]


def test_padding_keeps_batches_equal_over_ranks_and_workers() -> None:
    # 3 ranks x batch 2: 3 full steps of 6, then 2 positions for 3 ranks (one pad)
    lds = loaders(lambda: make_mix(samples_per_epoch=20), world=3, batch=2, workers=2)
    for epoch in range(2):
        plan = lds[0].plan
        assert plan.num_padded == 1
        pads = plan.indices(np.arange(20, 20 + plan.num_padded))
        with pytest.warns(evenly.EvenlyWarning, match="repeated"):
            batches = [[b.tolist() for b in loader] for loader in lds]
        assert {len(rank) for rank in batches} == {len(lds[0])} == {4}
        assert [len(b) for b in batches[0]] == [2, 2, 2, 1]
        ids = [x for rank in batches for b in rank for x in b]
        expected = np.array(list(make_mix(samples_per_epoch=20).counts.values()))
        expected += np.bincount(lds[0].dataset.source.source_of(pads), minlength=3)
        assert per_source(ids) == expected.tolist(), epoch


def test_no_rank_is_favoured_inside_a_step() -> None:
    # 50/50, batch 1, 2 ranks: every step holds one slot of each source, dealt by a keyed
    # bijection, so each rank gets about half of each source (a fixed deal would give
    # rank 0 all of one source)
    make = lambda: Mix(sources({"a": 100, "b": 100}))  # noqa: E731
    per_rank = [
        per_source([x for b in rank for x in b])[:2]
        for rank in run(loaders(make, world=2, batch=1, workers=0), 1)[0]
    ]
    assert per_rank[0][0] + per_rank[1][0] == 100
    assert all(35 <= n <= 65 for counts in per_rank for n in counts), per_rank


def test_without_weights_a_mix_is_a_concatenation() -> None:
    make = lambda: Mix(sources())  # noqa: E731
    assert len(make()) == sum(LENGTHS.values())
    lds = loaders(make, world=1, batch=5, workers=2)
    epochs = run(lds, 2)
    every = sorted(x for s in sources().values() for x in s)
    for epoch in epochs:
        assert sorted(x for b in epoch[0] for x in b) == every
    assert epochs[0] != epochs[1]


def test_set_epoch_replays_an_epoch_exactly() -> None:
    lds = loaders(make_mix, world=2, batch=4, workers=2)
    epochs = run(lds, 2)
    for loader in lds:
        loader.set_epoch(0)
    assert run(lds, 1)[0] == epochs[0]


def test_batches_read_each_source_once_and_errors_name_the_source() -> None:
    class Recording(list[int]):
        def __init__(self, items: range) -> None:
            super().__init__(items)
            self.calls: list[list[int]] = []

        def __getitems__(self, indices: list[int]) -> list[int]:
            self.calls.append(list(indices))
            return [self[i] for i in indices]

    web, code = Recording(range(10)), Recording(range(1000, 1004))
    mix = Mix({"web": web, "code": code, "books": [2000]})
    loader = evenly.DataLoader(evenly.Dataset(mix, shuffle=True), batch_size=15)
    (batch,) = [b.tolist() for b in loader]
    assert sorted(batch) == [*range(10), *range(1000, 1004), 2000]
    assert len(web.calls) == len(code.calls) == 1  # one call per source and batch
    assert mix.locate(11) == "source 'code' sample 1"
    with pytest.raises(IndexError, match=r"index 15 is out of range \[0, 15\)"):
        mix.read_one(15)


@pytest.mark.parametrize(
    ("kw", "error", "message"),
    [
        ({"weights": {"web": 1, "code": 1}}, ValueError, r"missing: \['books'\]"),
        ({"weights": {**WEIGHTS, "news": 1}}, ValueError, r"unknown: \['news'\]"),
        ({"weights": {**WEIGHTS, "code": -1}}, ValueError, "'code' must be >= 0"),
        ({"weights": {**WEIGHTS, "code": "1"}}, TypeError, "'code' must be a number"),
        ({"samples_per_epoch": 0}, ValueError, "samples_per_epoch must be >= 1"),
        ({"lengths": {"web": 3, "code": 0, "books": 1}}, ValueError, "'code' is empty"),
        ({"min_step": 0}, ValueError, "min_step must be >= 1"),
    ],
)
def test_bad_settings_raise_naming_the_source_or_setting(
    kw: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        make_mix(**kw)


def test_a_source_without_len_or_getitem_is_refused_by_name() -> None:
    with pytest.raises(TypeError, match="source 'web'"):
        Mix({"web": iter(range(3))})  # type: ignore[dict-item]


# ---- resume --------------------------------------------------------------------------------


def interrupted(
    make: Callable[[], Mix], k: int, world: int = 2
) -> tuple[dict[str, Any], list[int]]:
    """Every rank (batch 4, 2 workers) receives k batches of epoch 0: rank 0's state
    (through JSON) and the ids received.  ``len(dataset)`` plans the same epoch in steps of
    world_size (as a framework asking for it would): the state follows the loader's pass."""
    lds, ids = loaders(make, world=world, batch=4, workers=2), []
    for loader in lds:
        it = iter(loader)
        ids += [x for _ in range(k) for x in next(it).tolist()]
        del it
    assert len(lds[0].dataset) == 40 // world
    return json.loads(json.dumps(lds[0].state_dict())), ids


@pytest.mark.parametrize(("world", "batch", "workers"), [(4, 2, 1), (1, 16, 0), (1, 8, 2)])
def test_resume_mid_epoch_under_other_ranks_and_workers_delivers_exactly_the_rest(
    world: int, batch: int, workers: int
) -> None:
    reference = run(loaders(make_mix, world=2, batch=4, workers=0), 2)
    full = [sorted(x for rank in epoch for b in rank for x in b) for epoch in reference]
    state, first = interrupted(make_mix, k=3)
    assert (state["epoch"], state["position"]) == (0, 24)
    lds = loaders(make_mix, world=world, batch=batch, workers=workers)
    for loader in lds:
        loader.load_state_dict(state)
    rest, following = run(lds, 2)
    assert len({len(rank) for rank in rest}) == 1  # equal batches on every rank
    assert sorted(first + [x for rank in rest for b in rank for x in b]) == full[0]
    assert sorted(x for rank in following for b in rank for x in b) == full[1]


def test_resume_onto_a_smaller_step_raises_naming_min_step_and_min_step_allows_it() -> None:
    state, _ = interrupted(make_mix, k=2)  # steps of 8 (2 ranks x 4)
    (small,) = loaders(make_mix, world=1, batch=4, workers=0)
    small.load_state_dict(state)
    assert len(small) == 2 + 6  # planning works (len() too): reading raises
    with pytest.raises(ValueError, match="min_step"):
        next(iter(small))
    make = lambda: make_mix(min_step=4)  # noqa: E731
    state, first = interrupted(make, k=2)
    (small,) = loaders(make, world=1, batch=4, workers=0)
    small.load_state_dict(state)
    rest = [x for b in small for x in b.tolist()]
    full = run(loaders(make, world=2, batch=4, workers=0), 1)[0]
    assert sorted(first + rest) == sorted(x for rank in full for b in rank for x in b)


def test_loaded_state_travels_to_spawn_workers() -> None:
    reference = run(loaders(make_mix, world=2, batch=4, workers=0), 1)[0]
    state, first = interrupted(make_mix, k=3)
    (loader,) = loaders(make_mix, world=1, batch=8, workers=1, multiprocessing_context="spawn")
    loader.load_state_dict(state)
    rest = [x for b in loader for x in b.tolist()]
    assert sorted(first + rest) == sorted(x for rank in reference for b in rank for x in b)


def test_weight_change_at_an_epoch_boundary_continues_every_stream() -> None:
    old = make_mix()  # counts 20, 12, 8
    (loader,) = loaders(make_mix, world=1, batch=4, workers=2, shuffle=False)
    first = [x for b in loader for x in b.tolist()]
    state = json.loads(json.dumps(loader.state_dict()))
    assert (state["epoch"], state["position"]) == (1, 0)
    make_new = lambda: make_mix(weights={"web": 1, "code": 1, "books": 1}, samples_per_epoch=30)  # noqa: E731
    lds = loaders(make_new, world=2, batch=3, workers=2, shuffle=False)
    for ld in lds:
        ld.load_state_dict(state)
    epochs = run(lds, 2)
    offsets = list(old.counts.values())
    for epoch in epochs:  # without shuffle, stream item i of a source is sample i % length
        ids = sorted(x for rank in epoch for b in rank for x in b)
        expected = sorted(
            1000 * d + (offsets[d] + j) % n
            for d, n in enumerate(LENGTHS.values())
            for j in range(10)
        )
        assert ids == expected
        offsets = [o + 10 for o in offsets]
    # without the state, the new weights would replay the streams from 0 (20, 12, 8 items
    # later they would differ): the load is what continues them
    fresh = run(loaders(make_new, world=2, batch=3, workers=0, shuffle=False), 2)[1]
    assert sorted(x for rank in fresh for b in rank for x in b) != sorted(
        x for rank in epochs[0] for b in rank for x in b
    )
    assert_once_before_twice(first + [x for e in epochs for r in e for b in r for x in b])


def test_weight_change_mid_epoch_raises_state_error() -> None:
    state, _ = interrupted(make_mix, k=2)
    (loader,) = loaders(lambda: make_mix(weights={"web": 1, "code": 1, "books": 1}), 1, 4, 0)
    with pytest.raises(evenly.StateError, match="only at an epoch boundary"):
        loader.load_state_dict(state)


@pytest.mark.parametrize(
    ("lengths", "name"),
    [({"web": 23, "code": 8, "books": 1}, "code"), ({"web": 23, "code": 7, "novels": 1}, "novels")],
)
def test_other_source_names_or_lengths_raise_state_error_naming_the_source(
    lengths: dict[str, int], name: str
) -> None:
    state, _ = interrupted(make_mix, k=0)
    weights = dict(zip(lengths, WEIGHTS.values(), strict=True))
    ds = evenly.Dataset(Mix(sources(lengths), weights=weights, samples_per_epoch=40))
    with pytest.raises(evenly.StateError, match=name):
        ds.load_state_dict(state)
    with pytest.raises(evenly.StateError, match=f"source '{name}'"):
        ds.source.load_source_state(state["source_state"], 0, 0)


# ---- the plan, over many mixtures ----------------------------------------------------------


@st.composite
def mixtures(draw: st.DrawFn) -> tuple[dict[str, int], dict[str, int], int]:
    n = draw(st.integers(1, 4))
    lengths = {f"s{d}": draw(st.integers(1, 12)) for d in range(n)}
    weights = {name: draw(st.integers(0, 9)) for name in lengths}
    if not any(weights.values()):
        weights["s0"] = 1
    return lengths, weights, draw(st.integers(1, 60))


@given(mixtures(), st.integers(1, 3), st.integers(1, 4), st.integers(1, 3), st.booleans())
@settings(max_examples=60, deadline=None)
def test_plans_over_ranks_and_workers_are_exact_per_source_and_epoch(
    mixture: tuple[dict[str, int], dict[str, int], int],
    world: int,
    batch: int,
    workers: int,
    drop_last: bool,
) -> None:
    lengths, weights, total = mixture
    mix = Mix(sources(lengths), weights=weights, samples_per_epoch=total)
    counts = np.array(list(mix.counts.values()))
    ds = evenly.Dataset(mix, shuffle=True, seed=1, drop_last=drop_last)
    seen: list[int] = []
    for epoch in range(3):
        spec = PassSpec(epoch, 0, total, batch, drop_last, 0, world)
        plan = ds._planner.plan_for(spec)
        per_rank = []
        for rank in range(world):
            chunks = [
                p.tolist()
                for w in range(workers)
                for p, _ in plan.iter_worker_chunks(rank, workers, w)
            ]
            positions = sorted(x for c in chunks for x in c)
            assert positions == sorted(plan.rank_positions(rank).tolist())
            per_rank.append(len(positions))
        assert len(set(per_rank)) == 1  # equal samples (so batches) on every rank
        real = np.arange(plan.end)
        ids = plan.indices(real)
        if not drop_last:
            assert (
                np.bincount(mix.source_of(ids), minlength=len(counts)).tolist() == counts.tolist()
            )
        seen += mix.read_many(ids.tolist())  # the sample ids (1000 * d + i)
        if not drop_last:
            assert_once_before_twice(seen, lengths)


def test_a_state_loaded_under_running_persistent_workers_reaches_them() -> None:
    """The loaded state's stream offsets travel with the pass to workers that started
    before the load (persistent workers of a loader that already ran an epoch)."""
    (saver,) = loaders(make_mix, world=1, batch=4, workers=0, shuffle=False)
    run([saver], 1)
    state = json.loads(json.dumps(saver.state_dict()))  # epoch 1, streams after epoch 0
    make_new = lambda: make_mix(weights={"web": 1, "code": 1, "books": 1}, samples_per_epoch=30)  # noqa: E731
    (running,) = loaders(make_new, world=1, batch=3, workers=2, shuffle=False)
    run([running], 1)  # the workers start (and persist) before the load
    running.load_state_dict(state)
    (fresh,) = loaders(make_new, world=1, batch=3, workers=0, shuffle=False)
    fresh.load_state_dict(state)
    assert run([running], 2) == run([fresh], 2)


def test_a_state_loaded_into_one_loader_is_not_seen_by_another_over_the_same_mix() -> None:
    """What a loaded state fixes (stream offsets) belongs to the loader that loaded it."""
    (saver,) = loaders(make_mix, world=1, batch=4, workers=0)
    run([saver], 2)
    state = json.loads(json.dumps(saver.state_dict()))
    ds = evenly.Dataset(make_mix(), shuffle=True, seed=7, rank=0, world_size=1)
    resumed = evenly.DataLoader(ds, batch_size=4)
    other = evenly.DataLoader(ds, batch_size=4)
    resumed.load_state_dict(state)
    untouched = evenly.DataLoader(
        evenly.Dataset(make_mix(), shuffle=True, seed=7, rank=0, world_size=1), batch_size=4
    )
    assert run([other], 1) == run([untouched], 1)
    assert run([resumed], 1) == run([saver], 1)


def test_a_mix_is_not_a_sequence_and_says_how_to_read_it(tmp_path: Any) -> None:
    """len(mix) is the samples per epoch while its indices span the concatenated sources:
    code that indexes range(len(mix)) would read a prefix, so indexing raises, naming
    evenly.Dataset (Subset, evenly.write), and a Mix inside a Mix is refused when built."""
    mix = make_mix()
    with pytest.raises(TypeError, match=r"not a sequence.*evenly\.Dataset\(mix\)"):
        mix[0]
    with pytest.raises(TypeError, match="not a sequence"):
        list(torch.utils.data.DataLoader(torch.utils.data.Subset(mix, range(len(mix)))))
    with pytest.raises(TypeError, match="not a sequence"):
        evenly.write(mix, str(tmp_path / "out"))
    with pytest.raises(TypeError, match=r"source 'inner' is itself an evenly.Mix"):
        Mix({"inner": make_mix(), "other": list(range(5))})
    ds = evenly.Dataset(mix, shuffle=True)  # the way to read it: every epoch exact
    counts = per_source([int(x) for b in evenly.DataLoader(ds, batch_size=8) for x in b])
    assert [counts[d] for d in range(3)] == list(mix.counts.values())
