"""The packing core (pure numpy): concat and best_fit plans, property-tested.

Every token of every document lands in exactly one row once, rows hold at most seq_len
tokens, locating any row directly equals replaying the whole epoch, best_fit never splits
a document that fits and equals a one-document-at-a-time reference of its rule, and its
padding stays within 20% of the ideal row count on documents that all fit.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from evenly.core.packing.best_fit import FittedRows, best_fit_chunks, row_index
from evenly.core.packing.concat import ConcatRows, concat_checkpoints
from evenly.core.packing.pieces import assemble
from evenly.core.packing.settings import Packing

lengths_lists = st.lists(st.integers(0, 40), min_size=0, max_size=120)
seq_lens = st.integers(1, 17)


def _concat(lengths: np.ndarray, seq_len: int, stride: int) -> ConcatRows:
    at = lambda p: lengths[p]  # noqa: E731
    return ConcatRows(
        concat_checkpoints(at, lengths.size, stride=stride, chunk=stride * 2),
        at,
        lengths.size,
        seq_len=seq_len,
        stride=stride,
    )


def _fitted(lengths: np.ndarray, seq_len: int, window: int, open_rows: int, group: int):
    chunks = list(
        best_fit_chunks(
            lambda p: lengths[p],
            lengths.size,
            seq_len=seq_len,
            window=window,
            open_rows=open_rows,
            group=group,
        )
    )
    pieces = np.concatenate(chunks) if chunks else np.empty(0, dtype=chunks_dtype())
    num_rows = int(pieces["row"][-1]) + 1 if pieces.size else 0
    return FittedRows(pieces, row_index(pieces["row"], num_rows, stride=3), num_rows, stride=3)


def chunks_dtype():
    from evenly.core.packing.pieces import PIECE

    return PIECE


def _check_exactly_once(lengths: np.ndarray, table, seq_len: int) -> np.ndarray:
    """Every token of every document once; rows within seq_len; returns all pieces."""
    pieces = table.pieces(np.arange(table.num_rows))
    assert (pieces["len"] > 0).all()
    per_row = np.bincount(pieces["row"], weights=pieces["len"], minlength=table.num_rows)
    assert (per_row <= seq_len).all() and (per_row > 0).all()
    seen = [np.zeros(n, dtype=np.int64) for n in lengths.tolist()]
    for pos, start, n in zip(
        pieces["pos"].tolist(), pieces["start"].tolist(), pieces["len"].tolist(), strict=True
    ):
        seen[pos][start : start + n] += 1
    assert all((s == 1).all() for s in seen)
    return pieces


@settings(max_examples=60, deadline=None)
@given(lengths_lists, seq_lens, st.integers(1, 6))
def test_concat_reads_every_token_once_and_locates_rows_as_a_replay(lengths, seq_len, stride):
    arr = np.array(lengths, dtype=np.int64)
    table = _concat(arr, seq_len, stride)
    assert table.num_rows == -(-int(arr.sum()) // seq_len)
    pieces = _check_exactly_once(arr, table, seq_len)
    # the replay: the token stream in order, cut every seq_len tokens
    stream = [(p, t) for p, n in enumerate(lengths) for t in range(n)]
    replay = [stream[r * seq_len : (r + 1) * seq_len] for r in range(table.num_rows)]
    for r in np.random.default_rng(0).permutation(table.num_rows).tolist():
        fresh = _concat(arr, seq_len, stride).pieces(np.array([r]))  # located directly
        got = [
            (p, s + i)
            for p, s, n in zip(
                fresh["pos"].tolist(), fresh["start"].tolist(), fresh["len"].tolist(), strict=True
            )
            for i in range(n)
        ]
        assert got == replay[r]
    # only the last row is short
    per_row = np.bincount(pieces["row"], weights=pieces["len"], minlength=table.num_rows)
    assert (per_row[:-1] == seq_len).all()


def _reference_best_fit(lengths: list[int], seq_len: int, window: int, open_rows: int):
    """The rule of evenly.core.packing.best_fit, one document at a time."""
    out = []
    row = 0
    for w0 in range(0, len(lengths), window):
        docs = list(range(w0, min(w0 + window, len(lengths))))
        for p in docs:
            for k in range(lengths[p] // seq_len):
                out.append((row, p, k * seq_len, seq_len))
                row += 1
        run = 4 * open_rows
        items = sorted(
            ((lengths[p] % seq_len, p) for p in docs if lengths[p] % seq_len),
            key=lambda x: ((x[1] - w0) // run, -x[0], x[1]),
        )
        slots: list[list | None] = [None] * open_rows  # [room, row id, pieces]
        rows: list[list] = []
        for n, p in items:
            fitting = [(s[0], i) for i, s in enumerate(slots) if s is not None and s[0] >= n]
            if fitting:
                i = min(fitting)[1]
            else:
                free = [i for i, s in enumerate(slots) if s is None]
                i = free[0] if free else min((s[0], i) for i, s in enumerate(slots))[1]
                slots[i] = [seq_len, len(rows)]
                rows.append([])
            slots[i][0] -= n
            rows[slots[i][1]].append((p, (lengths[p] // seq_len) * seq_len, n))
        for pieces in rows:
            out.extend((row, p, s, n) for p, s, n in pieces)
            row += 1
    return out


@settings(max_examples=60, deadline=None)
@given(lengths_lists, seq_lens, st.integers(1, 9), st.integers(1, 4), st.integers(1, 5))
def test_best_fit_tokens_once_documents_whole_and_equal_to_the_reference(
    lengths, seq_len, window, open_rows, group_windows
):
    arr = np.array(lengths, dtype=np.int64)
    table = _fitted(arr, seq_len, window, open_rows, group=window * group_windows)
    pieces = _check_exactly_once(arr, table, seq_len)
    # a document that fits a row is one piece; a longer one gives full rows + a remainder
    for p, n in enumerate(lengths):
        mine = pieces[pieces["pos"] == p]
        assert len(mine) == n // seq_len + (1 if n % seq_len else 0)
    assert pieces.tolist() == _reference_best_fit(lengths, seq_len, window, open_rows)
    # any row located directly equals the full replay's
    for r in range(table.num_rows):
        assert table.pieces(np.array([r])).tolist() == pieces[pieces["row"] == r].tolist()


@settings(max_examples=10, deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from([256, 1024, 2048]))
def test_best_fit_padding_within_20_percent_of_ideal_on_documents_that_fit(seed, seq_len):
    rng = np.random.default_rng(seed)
    # log-normal lengths (median ~ seq_len / 4), all fitting in a row
    lengths = np.clip(rng.lognormal(np.log(seq_len / 4), 0.8, 5000).astype(np.int64), 1, seq_len)
    table = _fitted(lengths, seq_len, window=1024, open_rows=8, group=1 << 12)
    ideal = -(-int(lengths.sum()) // seq_len)
    assert table.num_rows <= 1.2 * ideal


def test_assemble_marks_pads_and_document_starts():
    tokens = {0: np.array([5, 6, 7]), 1: np.array([8, 9])}
    pieces = np.array([(0, 0, 0, 3), (1, 1, 0, 2)], dtype=chunks_dtype())
    out = assemble(
        np.array([0, 1, 2]), pieces, tokens, seq_len=4, pad_id=0, doc_index={0: 10, 1: 20}
    )
    assert out["input_ids"].tolist() == [[5, 6, 7, 0], [8, 9, 0, 0], [0, 0, 0, 0]]
    assert out["labels"].tolist() == [[-100, 6, 7, -100], [-100, 9, -100, -100], [-100] * 4]
    assert out["document_ids"].tolist() == [[11, 11, 11, 0], [21, 21, 0, 0], [0] * 4]


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"seq_len": 0}, ValueError),
        ({"seq_len": 8, "strategy": "first_fit"}, ValueError),
        ({"seq_len": 8, "tokenize": lambda t: [[1]]}, ValueError),  # no tokenizer_id
        ({"seq_len": 8, "tokenizer_id": "x"}, ValueError),
        ({"seq_len": 8, "pad_id": 1.5}, TypeError),
    ],
)
def test_packing_settings_are_validated(kwargs, error):
    with pytest.raises(error, match="Packing"):
        Packing(**kwargs)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 60), st.integers(1, 4), st.integers(1, 5), st.integers(0, 60))
def test_a_full_pad_plan_gives_every_rank_full_batches_and_each_position_once(
    n, world, batch, start
):
    from evenly.core.plan import EpochPlan

    start = min(start, n)
    plan = EpochPlan(num_samples=n, world_size=world, batch_size=batch, start=start, pad="full")
    per_rank = [plan.rank_positions(r) for r in range(world)]
    assert {p.size for p in per_rank} == {plan.num_batches * batch}  # full batches only
    every = np.concatenate(per_rank)
    real = np.sort(every[every < n])
    assert real.tolist() == list(range(start, n))  # the rest of the epoch, once
    assert plan.num_padded == every.size - (n - start) < world * batch
    assert plan.consumed_after(plan.num_batches) == n
