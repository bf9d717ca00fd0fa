"""The audit of packed datasets (``evenly.Dataset(pack=...)``): every token of every
document exactly once per epoch, judged from the pieces each rank delivered; the token
accounting as a pure function (property tests), then real audits (gloo ranks, DataLoader
workers) of right packed datasets and of packed loaders with one defect each
(``tests/zoo_packed.py``), with ``--resume``.
"""

from __future__ import annotations

import functools
import itertools
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from evenly.audit import Records, audit_many
from evenly.audit._coverage import compare, coverage, pad_rows, tokens
from evenly.audit._findings import full_batches
from evenly.audit._types import PackInfo

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # the rank processes inherit sys.path

from tests import zoo_packed  # noqa: E402

#: pad rows are reported by a warning at every pass start
pytestmark = pytest.mark.filterwarnings("ignore:evenly.*pad row:evenly.EvenlyWarning")


@st.composite
def cut_documents(draw: st.DrawFn) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Documents cut into pieces at random points, the pieces dealt to ranks in a random
    order: (lengths, piece columns)."""
    lengths = np.asarray(draw(st.lists(st.integers(0, 30), min_size=1, max_size=12)))
    cols: dict[str, list[int]] = {k: [] for k in ("doc", "start", "length")}
    for d, n in enumerate(lengths.tolist()):
        cuts = sorted(
            set(draw(st.lists(st.integers(1, max(n - 1, 1)), max_size=4))) & set(range(1, n))
        )
        bounds = [0, *cuts, n] if n else []
        for a, b in itertools.pairwise(bounds):
            cols["doc"].append(d)
            cols["start"].append(a)
            cols["length"].append(b - a)
    k = len(cols["doc"])
    perm = np.asarray(draw(st.permutations(range(k)))) if k else np.zeros(0, dtype=np.int64)
    out = {name: np.asarray(v, dtype=np.int64)[perm] for name, v in cols.items()}
    out["rank"] = np.asarray(
        draw(st.lists(st.integers(0, 2), min_size=k, max_size=k)), dtype=np.int64
    )
    out["epoch"] = np.zeros(k, dtype=np.int64)
    return lengths, out


@settings(max_examples=60, deadline=None)
@given(cut_documents(), st.data())
def test_token_accounting_passes_an_exact_tiling_and_counts_a_lost_or_repeated_piece(
    case: tuple[np.ndarray, dict[str, np.ndarray]], data: st.DataObject
) -> None:
    lengths, cols = case
    assert coverage(lengths=lengths, epochs=1, **cols) == []
    if not len(cols["doc"]):
        return
    i = data.draw(st.integers(0, len(cols["doc"]) - 1))
    doc, n = int(cols["doc"][i]), int(cols["length"][i])
    lost = {k: np.delete(v, i) for k, v in cols.items()}
    (found,) = coverage(lengths=lengths, epochs=1, **lost)
    assert (found.missing, found.repeated) == (n, 0)
    assert f"document {doc} tokens [{int(cols['start'][i])}, " in found.text
    again = {k: np.append(v, v[i]) for k, v in cols.items()}
    again["rank"][-1] = 7
    (found,) = coverage(lengths=lengths, epochs=1, **again)
    assert (found.missing, found.repeated) == (0, n)
    assert f"document {doc} tokens" in found.text and "by rank 7" in found.text


def test_token_accounting_names_a_document_never_delivered_and_tokens_past_its_end() -> None:
    lengths = np.array([3, 4])
    one = np.zeros(1, dtype=np.int64)
    (found,) = coverage(
        lengths=lengths, epochs=1, epoch=one, rank=one, doc=one, start=one, length=one + 5
    )
    assert (
        found.missing == 4 and "document 1 tokens [0, 4) (no piece of it delivered)" in found.text
    )
    assert "2 tokens past the end of their documents" in found.text


def test_the_audit_passes_packed_datasets_and_finds_each_packed_defect_resume_included() -> None:
    factories = [
        functools.partial(zoo_packed.packed, "concat"),
        functools.partial(zoo_packed.packed, "best_fit"),
        zoo_packed.one_rank_share,
        zoo_packed.forgets_position,
        zoo_packed.mixed,
        zoo_packed.mixed_one_rank_share,
    ]
    concat, best_fit, one_rank, forgets, mixed, mixed_one_rank = audit_many(
        factories, num_workers=1, world_size=2, epochs=2, batch_size=2, resume=True
    )
    # a Mix by tokens: its planned pieces (some documents twice) once each, not every
    # document once; with rank 0's share on every rank, the missing and repeated found
    assert mixed.ok and all(f.status == "PASS" for f in mixed.findings), mixed.findings
    assert "every planned token of the mixture" in mixed.finding("tokens").detail
    broken = mixed_one_rank.finding("tokens")
    assert broken.status == "FAIL" and "missing" in broken.detail and "repeated" in broken.detail
    for right in (concat, best_fit):
        assert right.ok, right.findings
        assert all(f.status == "PASS" for f in right.findings), right.findings
        tokens = right.finding("tokens")
        assert f"({sum(zoo_packed.LENGTHS)} tokens) delivered exactly once" in tokens.detail
        rows = -(-sum(zoo_packed.LENGTHS) // zoo_packed.SEQ)  # concat: whole rows
        if right is concat:
            pads = -rows % 4  # to fill the last global batch of 2 ranks x 2 rows
            assert (
                right.finding("pad_rows").detail
                == f"epochs 0-1: {pads} pad rows (the last global batch filled)"
            )
        assert "every batch 2 rows" in right.finding("full_batches").detail
    # every rank reads rank 0's share: rank 1's tokens missing, rank 0's repeated by rank 1
    found = one_rank.finding("tokens")
    assert found.status == "FAIL" and not one_rank.ok
    assert (
        "tokens repeated (document" in found.detail and "by rank 1, first by rank 0" in found.detail
    )
    assert "tokens missing (document" in found.detail
    # the resumed runs repeat only what the uninterrupted one got wrong: nothing more
    assert {f.status for f in one_rank.findings if f.name.startswith("resume_")} == {"PASS"}
    # a state that forgets the position: the epoch's first tokens come twice after a resume
    assert forgets.finding("tokens").status == "PASS"
    early = forgets.finding("resume_early")
    assert early.status == "FAIL" and "tokens repeated (document" in early.detail, early
    assert "repeated (e.g. document" in early.detail  # rows named by their first token
    assert forgets.finding("resume_epoch_boundary").status == "PASS"


@settings(max_examples=60, deadline=None)
@given(cut_documents(), st.integers(1, 3), st.data())
def test_planned_token_accounting_counts_each_planned_piece_once(case, times, data) -> None:
    """Against a plan that holds every document ``times`` times: the plan's pieces pass,
    one piece lost is that many tokens missing, one delivered twice that many repeated."""
    lengths, cols = case
    docs = np.repeat(np.arange(len(lengths)), times)
    expected = (docs, np.zeros(docs.size, dtype=np.int64), lengths[docs])
    delivered = tuple(np.tile(cols[k], times) for k in ("doc", "start", "length"))
    assert compare(expected, delivered)[:2] == (0, 0)
    if not cols["doc"].size:
        return
    i = data.draw(st.integers(0, cols["doc"].size - 1))
    n = int(cols["length"][i])
    fewer = tuple(np.delete(c, i) for c in delivered)
    assert compare(expected, fewer)[:2] == (n, 0)
    more = tuple(np.append(c, c[i]) for c in delivered)
    assert compare(expected, more)[:2] == (0, n)


def test_a_packed_dataset_resumed_onto_another_world_size_passes_with_its_new_padding() -> None:
    # 83 rows: 3 ranks x 3 rows pad 7 rows, 2 ranks x 3 rows pad 1: pad rows hold no data
    (result,) = audit_many(
        [functools.partial(zoo_packed.packed, "concat")],
        num_workers=1,
        world_size=3,
        epochs=2,
        batch_size=3,
        resume=True,
        resume_world_size=2,
        resume_workers=0,
    )
    assert result.ok and all(f.status == "PASS" for f in result.findings), result.findings
    pads = result.finding("pad_rows").detail
    assert pads == "epochs 0-1: 7 pad rows (the last global batch filled)"
    assert "5 stops resumed onto 2 ranks x 0 workers" in result.finding("resume").detail


def _packed_records(ids: list[int], rank: list[int], batch: list[int], pad: str) -> Records:
    """One epoch of rows (``ids < 0``: pad rows), one piece of 4 tokens per real row."""
    n = len(ids)
    zeros = np.zeros(n, dtype=np.int64)
    real = [i for i in range(n) if ids[i] >= 0]
    pieces = np.array([[i, i, 0, 4] for i in real], dtype=np.int64).reshape(-1, 4)
    pos = [sum(1 for j in range(i) if (rank[j], batch[j]) == (rank[i], batch[i])) for i in range(n)]
    return Records(
        ids=np.asarray(ids),
        rank=np.asarray(rank),
        worker=zeros,
        epoch=zeros,
        batch=np.asarray(batch),
        pos=np.asarray(pos),
        draws=np.zeros((n, 3)),
        per_rank=[],
        world_size=2,
        num_workers=0,
        epochs=1,
        batch_size=2,
        pack=PackInfo(8, pad, np.full(len(real), 4), (len(real),)),
        pieces=pieces,
    )


def test_pad_rows_beyond_the_last_global_batch_and_short_batches_fail() -> None:
    # 2 ranks x batch 2: 3 real rows need 1 pad row; 5 pad rows are more than minimal
    right = _packed_records([0, 1, 2, -1], [0, 0, 1, 1], [0, 0, 0, 0], "repeat")
    assert pad_rows(right).status == "PASS" and full_batches(right).status == "PASS"
    assert tokens(right).status == "PASS"
    padded = _packed_records(
        [0, 1, 2, -1, -2, -3, -4, -5], [0, 0, 1, 1, 0, 0, 1, 1], [0, 0, 0, 0, 1, 1, 1, 1], "repeat"
    )
    found = pad_rows(padded)
    assert found.status == "FAIL" and "5 pad rows, more than the 3" in found.detail
    short = _packed_records([0, 1, 2], [0, 0, 1], [0, 0, 0], "repeat")
    found = full_batches(short)
    assert found.status == "FAIL" and "fewer than 2 rows per rank [0, 1]" in found.detail
    assert full_batches(_packed_records([0, 1, 2], [0, 0, 1], [0, 0, 0], "none")).status == "WARN"


def test_a_mix_by_tokens_reweighted_mid_epoch_passes_and_its_rows_follow_the_new_weights() -> None:
    """``set_weights=`` over a Mix by tokens: the planned pieces after the change (as the
    loader plans them) are what every rank must deliver, resumed runs included."""
    (result,) = audit_many(
        [zoo_packed.mixed],
        num_workers=1,
        world_size=2,
        epochs=2,
        batch_size=2,
        resume=True,
        set_weights=[(0, 3, {"a": 1.0, "b": 3.0})],
    )
    assert result.ok and all(f.status == "PASS" for f in result.findings), result.findings
    assert "every planned token of the mixture" in result.finding("tokens").detail
