"""Online mixing: ``evenly.DataLoader.set_weights`` over an ``evenly.Mix``.

From the next batch the loader yields, the rest of the epoch follows the new weights
(within the stated bound of their share at every later global step boundary), every
source's stream continues (each item once), the state records the change (a fresh loader
built with the original weights resumes exactly, under other workers, batch sizes and
world sizes), and under real gloo ranks every rank must change at the same step.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

import evenly
from evenly import PlanMismatchError
from evenly.core.mix.apportion import mix_counts
from evenly.core.mix.order import MixOrder
from tests.distributed import run_ranks

NAMES = ("web", "code", "books")
LENGTHS = {"web": 37, "code": 11, "books": 5}
TOTAL, BATCH = 60, 4


def make_mix(weights: dict[str, float] | None = None) -> evenly.Mix:
    return evenly.Mix(
        {name: list(range(1000 * d, 1000 * d + n)) for d, (name, n) in enumerate(LENGTHS.items())},
        weights=weights or {"web": 0.5, "code": 0.3, "books": 0.2},
        samples_per_epoch=TOTAL,
    )


def expect(weights: dict[str, float], positions: int) -> dict[str, int]:
    """Per-source counts of ``positions`` by ``weights`` (largest remainder)."""
    counts = mix_counts(list(LENGTHS.values()), [weights[n] for n in NAMES], positions)
    return dict(zip(NAMES, counts, strict=True))


def source(x: int) -> str:
    return NAMES[x // 1000]


def flat(batches: list[Any]) -> list[int]:
    return [int(x) for b in batches for x in b]


# ---- the pure order -------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 30), min_size=2, max_size=4),
    data=st.data(),
)
def test_an_order_with_weight_changes_reads_each_stream_item_once_and_holds_the_bound(
    lengths: list[int], data: st.DataObject
) -> None:
    d = len(lengths)
    step = data.draw(st.integers(1, 6), label="step")
    steps = data.draw(st.integers(2, 12), label="steps per epoch")
    total = step * steps
    weights = data.draw(st.lists(st.integers(0, 5), min_size=d, max_size=d), label="w")
    if not any(weights):
        weights[0] = 1
    counts = mix_counts(lengths, weights, total)
    at = sorted(set(data.draw(st.lists(st.integers(1, steps - 1), max_size=3), label="at")))
    changes = []
    for k in at:
        new = data.draw(st.lists(st.integers(0, 5), min_size=d, max_size=d), label="w'")
        if not any(new):
            new[-1] = 1
        changes.append((k * step, mix_counts(lengths, new, total - k * step)))
    offsets = data.draw(st.lists(st.integers(0, 50), min_size=d, max_size=d), label="offsets")
    names = [f"s{i}" for i in range(d)]
    order = MixOrder(
        lengths,
        counts,
        offsets,
        names=names,
        seed=1,
        epoch=0,
        shuffle=True,
        step=step,
        changes=changes,
    )
    src, item = order.locate(np.arange(total))
    # every stream item of the epoch's window is read exactly once
    for s in range(d):
        got = sorted(item[src == s].tolist())
        assert got == list(range(offsets[s], offsets[s] + order.totals[s]))
    assert sum(order.totals) == total
    # after each change at P: at every later step boundary Q, each source's count in
    # [P, Q) is within the segment's bound of (Q - P) * c'_d / (total - P)
    starts = [0] + [p for p, _ in changes] + [total]
    for (p, rest), end in zip([(0, counts), *changes], starts[1:], strict=True):
        segment = MixOrder(
            lengths, rest, [0] * d, names=names, seed=0, epoch=0, shuffle=False, step=step
        )
        for q in range(p + step, end + 1, step):
            have = np.bincount(src[p:q], minlength=d)
            share = (q - p) * np.array(rest) / (total - p)
            assert (np.abs(have - share) <= np.array(segment.bounds) + 1e-9).all(), (p, q)


# ---- one process, real workers ------------------------------------------------------
def loader_of(weights: dict[str, float] | None = None, **kw: Any) -> evenly.DataLoader:
    ds = evenly.Dataset(make_mix(weights), shuffle=True, seed=5, rank=0, world_size=1)
    return evenly.DataLoader(ds, batch_size=kw.pop("batch_size", BATCH), **kw)


NEW = {"web": 0.1, "code": 0.1, "books": 0.8}


@pytest.mark.parametrize("workers", [0, 2])
def test_new_weights_apply_from_the_next_batch_and_streams_continue(workers: int) -> None:
    loader = loader_of(num_workers=workers)
    it = iter(loader)
    head = [next(it).tolist() for _ in range(5)]  # 20 samples at the original weights
    reference = flat([b.tolist() for b in loader_of()])[:20]
    assert flat(head) == reference
    loader.set_weights(NEW)
    rest = [b.tolist() for b in it]
    assert len(head) + len(rest) == len(loader) == TOTAL // BATCH
    counts = Counter(source(x) for x in flat(rest))
    assert counts == expect(NEW, 40)  # the rest of the epoch, by the new weights
    epoch0 = flat(head + rest)
    # the next epoch keeps the new weights, and continues each stream
    epoch1 = flat([b.tolist() for b in loader])
    c1 = Counter(source(x) for x in epoch1)
    assert c1 == expect(NEW, TOTAL)
    # each source's stream continued across the change and the epoch boundary: what it
    # read is a prefix of its stream of passes (every sample once before any twice)
    for name in NAMES:
        seen = Counter(x for x in epoch0 + epoch1 if source(x) == name)
        assert len(seen) == min(LENGTHS[name], sum(seen.values()))
        assert max(seen.values()) - min(seen.values()) <= 1


def test_set_weights_between_passes_applies_from_the_next_pass_first_batch() -> None:
    loader = loader_of()
    list(loader)
    loader.set_weights(NEW)
    c = Counter(source(x) for x in flat([b.tolist() for b in loader]))
    assert c == expect(NEW, TOTAL)


def _interrupted(change_at: int, stop_at: int) -> tuple[list[int], dict[str, Any]]:
    loader = loader_of(num_workers=2)
    it = iter(loader)
    got = []
    for k in range(stop_at):
        if k == change_at:
            loader.set_weights(NEW)
        got += next(it).tolist()
    if change_at == stop_at:  # changed, and saved before the next batch
        loader.set_weights(NEW)
    return got, json.loads(json.dumps(loader.state_dict()))


@pytest.mark.parametrize(("change_at", "stop_at"), [(3, 7), (6, 6), (2, 15)])
def test_a_state_after_a_change_resumes_exactly_in_a_loader_built_with_the_old_weights(
    change_at: int, stop_at: int
) -> None:
    full = loader_of(num_workers=2)
    it = iter(full)
    whole = []
    for k in range(TOTAL // BATCH):
        if k == change_at:
            full.set_weights(NEW)
        whole += next(it).tolist()
    whole_next = flat([b.tolist() for b in full])
    head, state = _interrupted(change_at, stop_at)
    # other workers, the original weights: the same rest, in the same order
    fresh = loader_of(num_workers=0)
    fresh.load_state_dict(state)
    if stop_at == TOTAL // BATCH:  # saved at the epoch's end: the next epoch, new weights
        assert head == whole
        assert flat([b.tolist() for b in fresh]) == whole_next
        return
    tail = flat([b.tolist() for b in fresh])
    assert head + tail == whole
    assert flat([b.tolist() for b in fresh]) == whole_next  # later epochs keep them
    # a larger batch (another global step): the same samples, dealt in its own steps
    wider = loader_of(num_workers=2, batch_size=8)
    wider.load_state_dict(state)
    assert Counter(flat([b.tolist() for b in wider])) == Counter(whole[len(head) :])


def test_bad_weights_and_sources_raise_naming_the_setting() -> None:
    loader = loader_of()
    with pytest.raises(ValueError, match=r"unknown: \['news'\]"):
        loader.set_weights({"web": 1, "code": 1, "books": 1, "news": 1})
    with pytest.raises(ValueError, match="must not all be 0"):
        loader.set_weights({"web": 0, "code": 0, "books": 0})
    plain = evenly.DataLoader(evenly.Dataset(list(range(10)), rank=0, world_size=1))
    with pytest.raises(TypeError, match=r"set_weights needs an evenly.Mix"):
        plain.set_weights({"a": 1})


# ---- real gloo ranks --------------------------------------------------------------------
def _run(rank: int, change_at: list[int], timeout: float) -> dict[str, Any]:
    ds = evenly.Dataset(make_mix(), shuffle=True, seed=5)
    ctx = "spawn" if rank == 0 else "fork"
    loader = evenly.DataLoader(
        ds, batch_size=BATCH, num_workers=2, multiprocessing_context=ctx, agreement_timeout=timeout
    )
    it = iter(loader)
    got: list[list[int]] = []
    try:
        for k in range(len(loader)):
            if k == change_at[rank]:
                loader.set_weights(NEW)
            got.append(next(it).tolist())
            dist.all_reduce(torch.ones(1))  # a collective per step, as DDP's backward
    except PlanMismatchError as exc:
        return {"error": str(exc)}
    except RuntimeError as exc:  # gloo: the other rank left its collective
        return {"gloo": str(exc)}
    return {"batches": got, "state": loader.state_dict()}


def _ranks(rank: int, world: int) -> list[dict[str, Any]]:
    # both ranks change at step 4; then rank 1 changes one step later than rank 0
    return [_run(rank, [4, 4], 60.0), _run(rank, [4, 5], 8.0)]


def test_under_two_gloo_ranks_a_change_at_the_same_step_is_exact_and_a_late_one_refused() -> None:
    same, late = zip(*run_ranks(_ranks, 2), strict=True)
    every = flat(same[0]["batches"]) + flat(same[1]["batches"])
    assert len(same[0]["batches"]) == len(same[1]["batches"])
    head = Counter(source(x) for r in same for x in flat(r["batches"][:4]))
    rest = Counter(source(x) for r in same for x in flat(r["batches"][4:]))
    assert rest == expect(NEW, TOTAL - 32)
    assert sum(head.values()) == 32
    for name, size in LENGTHS.items():  # a prefix of each stream: once before twice
        seen = Counter(x for x in every if source(x) == name)
        assert len(seen) == min(size, sum(seen.values()))
        assert max(seen.values()) - min(seen.values()) <= 1
    assert same[0]["state"] == same[1]["state"]
    # rank 0 waits for rank 1 at the restarted pass's check and raises naming it; rank 1
    # then loses its peer in the next collective
    assert "rank(s) [1]" in late[0]["error"], late[0]
    assert "error" in late[1] or "gloo" in late[1]
