"""``evenly.Mix(unit="tokens")`` under packing: the epoch's tokens apportioned by weight
at every prefix of its order, every token of each source's share exactly once (streams
continue across epochs, once before twice), the same rows for every topology, exact
resume onto another one, and what it refuses."""

from __future__ import annotations

import json
import warnings
from collections import Counter
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import evenly
from evenly.core.mix.deadline import floor_mul_div
from evenly.core.mix.tokens import (
    deviation_bound,
    merge_of,
    offsets_at,
    segmented_chunks,
    token_epoch,
    token_epoch_chunks,
    token_segments,
    token_shares,
)
from tests.distributed import in_fresh_process, run_ranks

pytestmark = pytest.mark.filterwarnings("ignore:evenly.*pad row:evenly.EvenlyWarning")
SEQ = 16
RNG = np.random.default_rng(11)
LENGTHS = {"web": RNG.integers(1, 40, size=40).tolist(), "code": RNG.integers(1, 60, size=9)}
BASE = {"web": 1_000_000, "code": 2_000_000}
WEIGHTS = {"web": 0.55, "code": 0.45}  # code (fewer tokens) is upsampled: its stream wraps
TOKENS = 1400


def docs(name: str) -> list[list[int]]:
    return [[BASE[name] + 1000 * i + t for t in range(int(n))] for i, n in enumerate(LENGTHS[name])]


def source_of(token: int) -> str:
    return "web" if token < 2_000_000 else "code"


def mix() -> evenly.Mix:
    return evenly.Mix(
        {n: docs(n) for n in LENGTHS}, weights=WEIGHTS, unit="tokens", tokens_per_epoch=TOKENS
    )


def dataset(
    rank: int | None = None, world: int | None = None, strategy: str = "concat", **kwargs: Any
) -> evenly.Dataset:
    pack = evenly.Packing(SEQ, strategy=strategy, document_ids=True)
    return evenly.Dataset(
        mix(), shuffle=True, seed=5, rank=rank, world_size=world, pack=pack, **kwargs
    )


def rows_of(batches: list[dict[str, torch.Tensor]]) -> list[list[int]]:
    return [row for b in batches for row in b["input_ids"].tolist()]


def reference(epoch: int = 0, strategy: str = "concat") -> list[list[int]]:
    loader = evenly.DataLoader(dataset(strategy=strategy), batch_size=1)
    loader.set_epoch(epoch)
    return rows_of(list(loader))


def interleave(per_rank: list[list[list[int]]], batch: int) -> list[list[int]]:
    out = []
    for s in range(max(len(r) for r in per_rank) // batch + 1):
        for rows in per_rank:
            out.extend(rows[s * batch : (s + 1) * batch])
    return out


def real(rows: list[list[int]]) -> list[list[int]]:
    return [r for r in rows if any(r)]


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EVENLY_CACHE_DIR", str(tmp_path / "cache"))


# ---- the planning core ---------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.lists(st.integers(0, 30), min_size=1, max_size=12), min_size=1, max_size=6),
    weights=st.lists(st.sampled_from([1, 2, 3, 9, 40]), min_size=6, max_size=6),
    tokens=st.integers(1, 400),
    seq_len=st.integers(1, 12),
    shuffle=st.booleans(),
    seed=st.integers(0, 3),
)
def test_core_every_token_once_before_twice_pieces_and_the_share_bound(
    lengths, weights, tokens, seq_len, shuffle, seed
):
    totals = [sum(x) for x in lengths]
    w = [wt if n else 0 for wt, n in zip(weights, totals, strict=False)]
    if not any(w):
        return
    shares = token_shares(totals, w, tokens)
    arrays = [np.array(x, dtype=np.int32) for x in lengths]
    names = [f"s{d}" for d in range(len(lengths))]
    bases = np.concatenate([[0], np.cumsum([len(x) for x in lengths])[:-1]])
    bound = deviation_bound(shares, seq_len)
    assert max(bound) <= seq_len  # within one row, whatever the weights
    seen: Counter[tuple[int, int]] = Counter()
    for epoch in range(3):
        items = token_epoch(
            arrays, shares, seq_len=seq_len, seed=seed, epoch=epoch, shuffle=shuffle, names=names
        )
        windowed = token_epoch_chunks(
            arrays,
            shares,
            seq_len=seq_len,
            seed=seed,
            epoch=epoch,
            shuffle=shuffle,
            names=names,
            chunk=3,
        )
        assert np.concatenate([items[:0], *windowed]).tolist() == items.tolist()
        assert ((items["len"] >= 1) & (items["len"] <= seq_len)).all()
        src = np.searchsorted(bases, items["doc"], side="right") - 1
        per = np.zeros((len(lengths), items.size + 1))
        np.add.at(per, (src, np.arange(1, items.size + 1)), items["len"])
        cum = np.cumsum(per, axis=1)  # each source's tokens after every item
        assert cum[:, -1].tolist() == list(shares)  # the epoch's share, exactly
        t = cum.sum(axis=0)
        p = np.array(shares) / sum(shares)
        dev = np.abs(cum - p[:, None] * t[None, :])
        assert (dev <= np.array(bound)[:, None] + 1e-9).all()
        for doc, start, n in items[["doc", "start", "len"]].tolist():
            d = int(np.searchsorted(bases, doc, side="right") - 1)
            assert start + n <= lengths[d][doc - bases[d]]
            seen.update((doc, start + k) for k in range(n))
    for d, x in enumerate(lengths):  # 3 epochs of the stream: once before twice
        if not totals[d]:
            continue
        q, extra = divmod(3 * shares[d], totals[d])
        counts = [seen[(bases[d] + i, k)] for i, n in enumerate(x) for k in range(n)]
        assert set(counts) <= {q, q + 1} and counts.count(q + 1) == extra


WEIGHTS_5 = st.lists(st.sampled_from([0, 1, 2, 5, 30]), min_size=5, max_size=5)


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.lists(st.integers(0, 20), min_size=1, max_size=8), min_size=2, max_size=5),
    changes=st.lists(st.tuples(st.floats(0.01, 0.99), WEIGHTS_5), max_size=3),
    tokens=st.integers(2, 200),
    seq_len=st.integers(1, 8),
)
def test_core_weight_changes_continue_every_stream_with_the_bound_per_segment(
    lengths, changes, tokens, seq_len
):
    totals = [sum(x) for x in lengths]
    if not all(totals):
        return
    arrays = [np.array(x, dtype=np.int32) for x in lengths]
    kw = {"seq_len": seq_len, "seed": 1, "shuffle": True, "names": list("abcde")[: len(lengths)]}
    segments = token_segments(None, 0, totals, None, tokens)
    part: dict[str, Any] = {
        "anchor_epoch": 0,
        "anchor_offsets": [0] * len(lengths),
        "weights": None,
        "changes": [],
    }
    for frac, w in changes:
        pos, w = int(frac * tokens), [float(x) for x in w[: len(lengths)]]
        if not sum(w) or pos <= max([0] + [c[0] for c in part["changes"]]):
            continue
        at = offsets_at(arrays, [s for s in segments if s.start < pos][-1], pos, **kw)
        part["changes"].append([pos, w, list(at)])
        segments = token_segments(part, 0, totals, None, tokens)
    bases = np.concatenate([[0], np.cumsum([len(x) for x in lengths])[:-1]])
    seen: Counter[tuple[int, int]] = Counter()
    used = np.zeros(len(lengths), dtype=np.int64)
    for epoch in range(2):
        segs = token_segments(part, epoch, totals, None, tokens)
        items = np.concatenate(list(segmented_chunks(arrays, segs, tokens, **kw)))
        assert int(items["len"].sum()) == tokens
        src = np.searchsorted(bases, items["doc"], side="right") - 1
        np.add.at(used, src, items["len"])
        for doc, start, n in items[["doc", "start", "len"]].tolist():
            seen.update((doc, start + k) for k in range(n))
        ends = np.cumsum(items["len"])
        for i, seg in enumerate(segs):  # the bound, inside each segment
            stop = segs[i + 1].start if i + 1 < len(segs) else tokens
            sel = (ends > seg.start) & (ends <= stop)
            have = np.zeros(len(lengths))
            bound = deviation_bound(seg.shares, seq_len)
            for d, n, e in zip(src[sel], items["len"][sel], ends[sel], strict=True):
                have[d] += n
                p = np.array(seg.shares) / sum(seg.shares) * (e - seg.start)
                assert (np.abs(have - p) <= np.array(bound) + 1e-9).all()
    for d, x in enumerate(lengths):  # each stream read as one prefix: once before twice
        q, extra = divmod(int(used[d]), totals[d])
        counts = [seen[(bases[d] + i, k)] for i, n in enumerate(x) for k in range(n)]
        assert set(counts) <= {q, q + 1} and counts.count(q + 1) == extra


def test_the_bound_is_under_one_row_for_up_to_three_sources():
    assert max(deviation_bound([5, 5], 100)) == 50
    assert max(deviation_bound([8, 1, 1], 100)) < 100
    assert merge_of([8, 1, 1]) == merge_of([3, 3, 2, 2]) == "midpoint"
    assert merge_of([6, 1, 1, 1]) == "deadline" and max(deviation_bound([6, 1, 1, 1], 100)) == 100


def _worst(items: np.ndarray, bases: np.ndarray, shares: list[int]) -> float:
    """The largest ``|tokens_d - p_d * t|`` over every item boundary of the order."""
    src = np.searchsorted(bases, items["doc"], side="right") - 1
    per = np.zeros((len(shares), items.size + 1))
    np.add.at(per, (src, np.arange(1, items.size + 1)), items["len"])
    cum = np.cumsum(per, axis=1)
    p = np.array(shares) / sum(shares)
    return float(np.abs(cum - p[:, None] * cum.sum(axis=0)[None, :]).max())


def test_a_dominant_source_among_many_stays_within_one_row(monkeypatch):
    """One source with 80% of the tokens and five small ones: merged by midpoint, the
    small sources' pieces line up and the dominant one falls more than a row behind;
    merged by deadline, every source stays within one row at every prefix."""
    import evenly.core.mix.tokens as tokens_mod

    rng = np.random.default_rng(3)
    seq_len = 64
    sizes = (800, 40, 40, 40, 40, 40)
    arrays = [rng.integers(1, 4 * seq_len, size=n).astype(np.int32) for n in sizes]
    totals = [int(a.sum()) for a in arrays]
    shares = list(token_shares(totals, [80, 4, 4, 4, 4, 4], sum(totals)))
    bases = np.concatenate([[0], np.cumsum([len(a) for a in arrays])[:-1]])
    kw = {"seq_len": seq_len, "seed": 2, "epoch": 0, "shuffle": True, "names": list("abcdef")}
    assert merge_of(shares) == "deadline"
    items = token_epoch(arrays, shares, **kw)
    assert _worst(items, bases, shares) <= seq_len
    assert int(items["len"].sum()) == sum(shares)
    monkeypatch.setattr(tokens_mod, "merge_of", lambda shares: "midpoint")
    assert _worst(token_epoch(arrays, shares, **kw), bases, shares) > seq_len


@settings(max_examples=200, deadline=None)
@given(
    a=st.lists(st.integers(-(10**12), 10**12), min_size=1, max_size=20),
    num=st.integers(1, 10**12),
    den=st.integers(1, 10**12),
)
def test_the_deadline_keys_are_exact_past_int64s_range(a, num, den):
    """``floor(a * num / den)`` in int64 equals Python's exact integers, where ``a *
    num`` is far past int64 (10^24) and the result is not."""
    assume(all(abs(x * num // den) < 2**62 for x in a))
    got = floor_mul_div(np.array(a, dtype=np.int64), num, den).tolist()
    assert got == [x * num // den for x in a]


def test_the_deadline_merge_is_the_same_whatever_its_windows(monkeypatch):
    """Fetched a few tokens at a time (pieces cut across windows), the same order."""
    import evenly.core.mix.deadline as deadline_mod

    rng = np.random.default_rng(4)
    arrays = [rng.integers(1, 50, size=n).astype(np.int32) for n in (300, 30, 30, 30)]
    shares = list(token_shares([int(a.sum()) for a in arrays], [9, 1, 1, 1], 9000))
    kw = {"seq_len": 16, "seed": 1, "epoch": 1, "shuffle": True, "names": list("abcd")}
    whole = token_epoch(arrays, shares, **kw)
    monkeypatch.setattr(deadline_mod, "FETCH", 37)
    assert token_epoch(arrays, shares, **kw).tolist() == whole.tolist()
    monkeypatch.setattr(deadline_mod, "FETCH", 5)  # windows where no piece starts
    assert token_epoch(arrays, shares, **kw).tolist() == whole.tolist()


# ---- through the loader --------------------------------------------------------------
def _check_shares(glob: list[list[int]], step: int, strategy: str = "concat") -> None:
    """At every global step boundary, each source's tokens within its bound of its share
    (``best_fit`` reorders documents inside its windows: exact per epoch only)."""
    shares = dict(zip(LENGTHS, mix().token_shares([sum(LENGTHS[n]) for n in LENGTHS]), strict=True))
    bound = dict(zip(LENGTHS, deviation_bound(list(shares.values()), SEQ), strict=True))
    have: Counter[str] = Counter()
    for k in range(0, len(glob), step):
        for row in glob[k : k + step]:
            have.update(source_of(t) for t in row if t)
        t = sum(have.values())
        for name, share in shares.items():
            if strategy == "concat":
                assert abs(have[name] - share / TOKENS * t) <= bound[name] <= SEQ
    assert dict(have) == shares


@pytest.mark.parametrize("strategy", ["concat", "best_fit"])
def test_every_share_exact_and_the_same_rows_for_every_topology(strategy):
    ref = reference(strategy=strategy)
    assert all(len(r) == SEQ for r in ref)
    if strategy == "concat":
        assert len(real(ref)) == -(-TOKENS // SEQ)
    _check_shares(ref, 1, strategy)
    rows = [
        (2, 2, 3, "fork", "process"),
        (3, 0, 2, None, "auto"),
        (1, 2, 4, "spawn", "process"),
        (2, 2, 2, None, "thread"),
    ]
    for world, workers, batch, context, kind in rows:
        per_rank = []
        for rank in range(world):
            ds = dataset(rank, world, strategy)
            kwargs = {"multiprocessing_context": context, "worker_type": kind}
            loader = evenly.DataLoader(ds, batch_size=batch, num_workers=workers, **kwargs)
            expected = len(loader)  # before the pass (best_fit: rows may differ by epoch)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", evenly.EvenlyWarning)
                batches = list(loader)
            assert expected == len(batches)
            per_rank.append(rows_of(batches))
        assert len({len(r) for r in per_rank}) == 1  # no rank can hang
        glob = interleave(per_rank, batch)
        assert real(glob) == real(ref)
        _check_shares(glob, world * batch, strategy)


def test_a_dominant_mix_of_four_is_within_one_row_at_every_step_through_real_workers():
    """Four sources, one with 85% of the tokens: merged by deadline; every global step
    boundary of two ranks with worker processes within one row of every share, the rows
    those of one process, every token of the epoch's shares once, and a resume onto
    another topology exact."""
    rng = np.random.default_rng(8)
    sizes = {"web": 60, "code": 6, "math": 6, "books": 6}
    base = {name: 1_000_000 * (k + 1) for k, name in enumerate(sizes)}
    corpus = {
        name: [
            [base[name] + 1000 * i + t for t in range(int(n))]
            for i, n in enumerate(rng.integers(8, 48, size=size))
        ]
        for name, size in sizes.items()
    }
    weights = {"web": 0.85, "code": 0.05, "math": 0.05, "books": 0.05}

    def make(rank: int | None = None, world: int | None = None) -> evenly.Dataset:
        m = evenly.Mix(corpus, weights=weights, unit="tokens", tokens_per_epoch=1600)
        return evenly.Dataset(
            m, shuffle=True, seed=3, rank=rank, world_size=world, pack=evenly.Packing(SEQ)
        )

    m = make().source
    shares = dict(
        zip(sizes, m.token_shares([sum(map(len, corpus[n])) for n in sizes]), strict=True)
    )
    assert merge_of(list(shares.values())) == "deadline"
    ref = rows_of(list(evenly.DataLoader(make(), batch_size=1)))
    per_rank = [
        rows_of(list(evenly.DataLoader(make(r, 2), batch_size=2, num_workers=2))) for r in range(2)
    ]
    glob = interleave(per_rank, 2)
    assert real(glob) == real(ref)
    owner = {t: name for name, d in corpus.items() for doc in d for t in doc}
    have: Counter[str] = Counter()
    for k in range(0, len(glob), 4):  # global steps of 2 ranks * 2 rows
        for row in glob[k : k + 4]:
            have.update(owner[t] for t in row if t)
        t = sum(have.values())
        for name, share in shares.items():
            assert abs(have[name] - share / 1600 * t) <= SEQ
    assert dict(have) == shares
    tokens = Counter(t for row in glob for t in row if t)
    assert max(tokens.values()) == 1  # every share fits in one pass of its source here
    loader = evenly.DataLoader(make(), batch_size=3)
    it = iter(loader)
    head = [next(it) for _ in range(7)]
    state = loader.state_dict()
    del it
    fresh = evenly.DataLoader(make(), batch_size=2, num_workers=2)  # another batch size
    fresh.load_state_dict(state)
    assert real(rows_of(head) + rows_of(list(fresh))) == real(ref)


@pytest.mark.parametrize("sources", [2, 4])
def test_a_state_saved_before_the_deadline_merge_loads_only_where_the_order_is_the_same(sources):
    """A state without ``merge`` (saved by the midpoint-only evenly) loads where the
    order did not change (no source dominates four or more); elsewhere it raises,
    naming why, instead of resuming other tokens."""
    names = ["web", "code", "math", "books"][:sources]
    corpus = {n: [[10 * k + i + 1 for i in range(5)]] * 8 for k, n in enumerate(names)}
    weights = dict(
        zip(names, [0.85, 0.05, 0.05, 0.05] if sources == 4 else [0.85, 0.15], strict=True)
    )

    def make() -> evenly.DataLoader:
        m = evenly.Mix(corpus, weights=weights, unit="tokens")
        ds = evenly.Dataset(m, shuffle=True, seed=1, pack=evenly.Packing(4))
        return evenly.DataLoader(ds, batch_size=1)

    loader = make()
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    del it
    old = json.loads(json.dumps(state))
    del old["source_state"]["merge"]
    fresh = make()
    if sources == 2:
        fresh.load_state_dict(old)
        assert rows_of(list(fresh)) == rows_of(list(make()))[1:]
    else:
        with pytest.raises(evenly.StateError, match="merged by deadline"):
            fresh.load_state_dict(old)
        fresh.load_state_dict(state)  # the state this evenly saved loads


def test_streams_continue_across_epochs_once_before_twice():
    seen: Counter[int] = Counter()
    for epoch in range(3):
        seen.update(t for row in reference(epoch) for t in row if t)
    for name in LENGTHS:
        tokens = [t for d in docs(name) for t in d]
        share = mix().token_shares([sum(LENGTHS[n]) for n in LENGTHS])[list(LENGTHS).index(name)]
        q, extra = divmod(3 * share, len(tokens))
        counts = [seen[t] for t in tokens]
        assert set(counts) <= {q, q + 1} and counts.count(q + 1) == extra
    assert reference(0) != reference(1)


def test_a_mix_of_sources_given_a_cache_dir_plans_there(tmp_path):
    """The sources' ``cache_dir=`` holds their lengths and the mixture's plans, not the
    default cache directory; the rows are those of the same documents in memory."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    given = tmp_path / "given"
    sources = {}
    for name in LENGTHS:
        pq.write_table(pa.table({"input_ids": docs(name)}), tmp_path / f"{name}.parquet")
        sources[name] = evenly.from_parquet(str(tmp_path / f"{name}.parquet"), cache_dir=str(given))
    mixed = evenly.Mix(sources, weights=WEIGHTS, unit="tokens", tokens_per_epoch=TOKENS)
    pack = evenly.Packing(SEQ, strategy="concat", document_ids=True)
    loader = evenly.DataLoader(
        evenly.Dataset(mixed, shuffle=True, seed=5, pack=pack), batch_size=1, num_workers=2
    )
    rows = rows_of(list(loader))
    assert len(list((given / "lengths").glob("*.i32"))) == len(LENGTHS)
    assert len(list((given / "packing").glob("*-e0.items"))) == 1
    default = tmp_path / "cache"  # $EVENLY_CACHE_DIR
    assert not (default / "lengths").exists() and not (default / "packing").exists()
    assert rows == reference()


def _tails(state: dict[str, Any], world: int, workers: int, batch: int) -> list[list[list[int]]]:
    per_rank = []
    for rank in range(world):
        loader = evenly.DataLoader(dataset(rank, world), batch_size=batch, num_workers=workers)
        loader.load_state_dict(state)
        per_rank.append(rows_of(list(loader)))
    return per_rank


def test_resume_mid_epoch_in_a_fresh_process_onto_another_topology():
    ref = reference(epoch=1)
    before = []
    for rank in range(2):
        loader = evenly.DataLoader(dataset(rank, 2), batch_size=3, num_workers=2)
        loader.set_epoch(1)
        it = iter(loader)
        before.append(rows_of([next(it) for _ in range(4)]))
        state = json.loads(json.dumps(loader.state_dict()))
    assert state["position"] == 24 and state["source_state"]["unit"] == "tokens"
    assert interleave(before, 3) == ref[:24]
    tails = in_fresh_process(_tails, state, 3, 1, 2)
    assert len({len(r) for r in tails}) == 1
    assert real(interleave(tails, 2)) == real(ref[24:])
    other = evenly.Mix(
        {n: docs(n) for n in LENGTHS},
        weights={"web": 1, "code": 1},
        unit="tokens",
        tokens_per_epoch=TOKENS,
    )
    pack = evenly.Packing(SEQ, document_ids=True)
    wrong = evenly.DataLoader(evenly.Dataset(other, shuffle=True, seed=5, pack=pack))
    with pytest.raises(evenly.StateError, match="weights"):
        wrong.load_state_dict(state)


def test_infinite_concat_streams_the_epochs_and_resumes_by_step():
    epochs = real(reference(0)) + real(reference(1))
    loader = evenly.DataLoader(dataset(), batch_size=4, infinite=True)
    it = iter(loader)
    head = rows_of([next(it) for _ in range(10)])
    fresh = evenly.DataLoader(dataset(), batch_size=2, infinite=True)
    fresh.load_state_dict(json.loads(json.dumps(loader.state_dict())))
    it2 = iter(fresh)
    tail = rows_of([next(it2) for _ in range((2 * len(reference(0)) - 40) // 2)])
    assert real(head + tail) == epochs


def _ddp_rows(rank: int, world_size: int) -> dict[str, list[list[int]]]:
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", evenly.EvenlyWarning)
        out["plain"] = rows_of(list(evenly.DataLoader(dataset(), batch_size=2, num_workers=2)))
        loader = evenly.DataLoader(dataset(), batch_size=2, num_workers=2)  # one launch
        it = iter(loader)
        head = rows_of([next(it) for _ in range(3)])
        loader.set_weights(NEW)  # on every rank at the same step: agreed
        out["changed"] = head + rows_of(list(it))
    return out


def test_real_gloo_ranks_read_the_one_process_rows_and_change_weights_together(tmp_path):
    env = {"EVENLY_CACHE_DIR": str(tmp_path / "ddp-cache")}
    per_rank = run_ranks(_ddp_rows, 2, env=env)
    plain = [r["plain"] for r in per_rank]
    assert len({len(r) for r in plain}) == 1
    assert real(interleave(plain, 2)) == real(reference())
    changed = [r["changed"] for r in per_rank]
    assert len({len(r) for r in changed}) == 1
    one, _ = _changed(0, 3, batch=4)  # one process, the same global steps
    assert real(interleave(changed, 2)) == real(one)


NEW = {"web": 0.2, "code": 0.8}


def _changed(workers: int, at: int, batch: int = 2) -> tuple[list[list[int]], dict[str, Any]]:
    """Epoch 0 read with set_weights(NEW) after ``at`` batches; the state at the end."""
    loader = evenly.DataLoader(dataset(), batch_size=batch, num_workers=workers)
    rows, it = [], iter(loader)
    rows += rows_of([next(it) for _ in range(at)])
    loader.set_weights(NEW)
    rows += rows_of(list(it))
    return rows, json.loads(json.dumps(loader.state_dict()))


def _check_rest(rows: list[list[int]], start: int, step: int) -> None:
    """From row ``start`` on, each source within its bound of its share of the rest."""
    totals = [sum(LENGTHS[n]) for n in LENGTHS]
    done = Counter(source_of(t) for row in rows[:start] for t in row if t)
    rest = TOKENS - sum(done.values())
    shares = token_shares(totals, list(NEW.values()), rest)
    bound = deviation_bound(shares, SEQ)
    have: Counter[str] = Counter()
    for k in range(start, len(rows), step):
        for row in rows[k : k + step]:
            have.update(source_of(t) for t in row if t)
        t = sum(have.values())
        for name, share, b in zip(LENGTHS, shares, bound, strict=True):
            assert abs(have[name] - share / rest * t) <= b
    assert [have[n] for n in LENGTHS] == list(shares)


@pytest.mark.parametrize("workers", [0, 2])
def test_set_weights_mid_epoch_keeps_the_rows_read_and_mixes_the_rest_by_the_new_weights(
    workers,
):
    ref = reference()
    rows, state = _changed(workers, 5)
    assert rows[:10] == ref[:10]  # what the loop had received stays as it was
    _check_rest(rows, 10, 2)
    seen = Counter(t for row in rows for t in row if t)
    assert max(seen.values()) == 1 or all(  # no token twice unless its stream wrapped
        source_of(t) == "code" for t, c in seen.items() if c > 1
    )
    # the next epoch: every share by the new weights; a fresh loader built with the
    # original weights continues from the saved state exactly
    loader = evenly.DataLoader(dataset(), batch_size=2, num_workers=workers)
    loader.load_state_dict(state)
    nxt = rows_of(list(loader))
    have = Counter(source_of(t) for row in nxt for t in row if t)
    totals = [sum(LENGTHS[n]) for n in LENGTHS]
    assert [have[n] for n in LENGTHS] == list(token_shares(totals, list(NEW.values()), TOKENS))
    again, _ = _changed(workers, 5)
    assert again == rows


def test_set_weights_state_mid_epoch_resumes_in_a_fresh_loader_of_another_topology():
    loader = evenly.DataLoader(dataset(), batch_size=2)
    it = iter(loader)
    head = rows_of([next(it) for _ in range(4)])
    loader.set_weights(NEW)
    head += rows_of([next(it) for _ in range(3)])
    state = json.loads(json.dumps(loader.state_dict()))
    rest = rows_of(list(it))
    tails = in_fresh_process(_tails, state, 2, 1, 3)
    assert real(interleave(tails, 3)) == real(rest)
    best = evenly.DataLoader(dataset(strategy="best_fit"), batch_size=2)
    next(iter(best))
    with pytest.raises(ValueError, match="strategy='concat'"):
        best.set_weights(NEW)


def test_refusals_name_the_setting():
    with pytest.raises(ValueError, match=r"pack=evenly\.Packing"):
        evenly.Dataset(mix())
    with pytest.raises(ValueError, match="no per-document transform"):
        evenly.Dataset(mix(), pack=evenly.Packing(SEQ), transform=lambda d: d)
    with pytest.raises(ValueError, match="takes no samples_per_epoch"):
        evenly.Mix({"a": [[1]]}, samples_per_epoch=3, unit="tokens")
    with pytest.raises(ValueError, match="needs unit='tokens'"):
        evenly.Mix({"a": [[1]]}, tokens_per_epoch=3)
    with pytest.raises(ValueError, match="no tokens but weight"):
        bad = evenly.Mix({"a": [[1]], "b": [[]]}, weights={"a": 1, "b": 1}, unit="tokens")
        list(evenly.DataLoader(evenly.Dataset(bad, pack=evenly.Packing(4)), batch_size=1))
    loader = evenly.DataLoader(dataset(), batch_size=2, infinite=True)
    with pytest.raises(ValueError, match="infinite=True"):
        loader.set_weights({"web": 1.0, "code": 2.0})


def test_a_source_file_rewritten_between_epochs_stops_the_next_pass(tmp_path):
    """The Mix checks each source's files at every pass start, as a single source does."""
    for name in LENGTHS:
        evenly.write(
            [{"input_ids": d} for d in docs(name)], tmp_path / name, "arrow", 4, progress=False
        )
    sources = {n: evenly.from_arrow(str(tmp_path / n)) for n in LENGTHS}
    mixed = evenly.Mix(sources, weights=WEIGHTS, unit="tokens", tokens_per_epoch=TOKENS)
    loader = evenly.DataLoader(evenly.Dataset(mixed, pack=evenly.Packing(SEQ)), batch_size=2)
    assert sum(int((b["input_ids"] > 0).sum()) for b in loader) == TOKENS
    shard = sorted((tmp_path / "code").glob("*.arrow"))[0]
    shard.write_bytes(shard.read_bytes())  # same bytes, another inode and ctime
    with pytest.raises(ValueError, match=rf"{shard.name}\) changed since the source was opened"):
        next(iter(loader))  # at the pass start, before any read
