"""``evenly audit`` of an ``evenly.Dataset`` over an ``evenly.Mix``: samples per source per
epoch (``mix_counts``) and duplicates/missing judged per source stream.

The findings are checked as pure functions of records built from honest streams
(hypothesis), then on real audits: 2 rank processes (gloo) x 2 DataLoader workers x 3
epochs, one group of ranks for all factories (``audit_many``).  The wrong mixtures are
``evenly.Mix`` subclasses with a deliberate bug in their plan (``epoch_order``), the part
of a mixture the audit must catch going wrong.
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console

import evenly
from evenly.audit import AuditResult, Records, audit_many
from evenly.audit._coverage import (
    delivered,
    duplicates,
    missing,
    mix_counts,
    stream_duplicates,
    stream_missing,
)
from evenly.audit._table import mix_table
from evenly.audit._types import MixInfo

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # the rank processes inherit sys.path

SOURCES = {"web": list(range(23)), "code": list(range(100, 107)), "books": [200]}
WEIGHTS = {"web": 5, "code": 3, "books": 2}
#: web 20 of 23 (a window that moves), code 12 of 7 (one pass and 5), books 8 of 1.
COUNTS = {"web": 20, "code": 12, "books": 8}
EPOCHS, WORLD, WORKERS, BATCH = 3, 2, 2, 4

Order = Callable[[npt.ArrayLike], npt.NDArray[np.int64]]


# ---- synthetic records -------------------------------------------------------------
def stream_reads(
    lengths: list[int], counts: list[int], epochs: int, seed: int
) -> list[npt.NDArray[np.int64]]:
    """Global indices an honest Mix reads per epoch: each source an endless stream of
    random permutations, epoch ``e`` taking the next ``counts[d]`` items; the epoch's
    order shuffled."""
    rng = np.random.default_rng(seed)
    bases = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    streams = []
    for n, c in zip(lengths, counts, strict=True):
        passes = -(-c * epochs // n) if n else 0
        items = [rng.permutation(n) for _ in range(passes)]
        streams.append(np.concatenate(items) if items else np.zeros(0, dtype=np.int64))
    out = []
    for e in range(epochs):
        parts = [streams[d][e * c : (e + 1) * c] + bases[d] for d, c in enumerate(counts) if c]
        out.append(rng.permutation(np.concatenate(parts)).astype(np.int64))
    return out


def mix_records(
    reads_per_epoch: list[npt.NDArray[np.int64]],
    lengths: list[int],
    counts: list[int],
    world_size: int = 1,
) -> Records:
    """One row per read, dealt round-robin to ``world_size`` ranks; the id is the read."""
    reads = np.concatenate(reads_per_epoch).astype(np.int64)
    epoch = np.concatenate([np.full(len(r), e) for e, r in enumerate(reads_per_epoch)])
    slot = np.concatenate([np.arange(len(r)) for r in reads_per_epoch]).astype(np.int64)
    n = len(reads)
    offsets = tuple(tuple(e * c for c in counts) for e in range(len(reads_per_epoch)))
    return Records(
        ids=reads.copy(),
        rank=slot % world_size,
        worker=np.zeros(n, dtype=np.int64),
        epoch=epoch.astype(np.int64),
        batch=slot // world_size,
        pos=np.zeros(n, dtype=np.int64),
        draws=np.random.default_rng(0).random((n, 3)),
        per_rank=[],
        world_size=world_size,
        num_workers=0,
        epochs=len(reads_per_epoch),
        batch_size=1,
        expected=sum(counts),
        mix=MixInfo(
            tuple(f"s{d}" for d in range(len(lengths))), tuple(lengths), tuple(counts), offsets
        ),
        reads=reads,
    )


@st.composite
def mixtures(draw: st.DrawFn) -> tuple[list[int], list[int], int, int]:
    k = draw(st.integers(1, 4))
    lengths = draw(st.lists(st.integers(1, 12), min_size=k, max_size=k))
    counts = draw(st.lists(st.integers(0, 30), min_size=k, max_size=k))
    if sum(counts) == 0:
        counts[0] = 1
    return lengths, counts, draw(st.integers(1, 4)), draw(st.integers(0, 2**16))


@settings(max_examples=60, deadline=None)
@given(mixtures())
def test_an_honest_mixture_passes_and_a_sample_read_from_the_wrong_source_fails(
    case: tuple[list[int], list[int], int, int],
) -> None:
    lengths, counts, epochs, seed = case
    reads = stream_reads(lengths, counts, epochs, seed)
    rec = mix_records(reads, lengths, counts)
    assert delivered(rec).tolist() == [counts] * epochs
    for finding in (mix_counts(rec), stream_duplicates(rec), stream_missing(rec)):
        assert finding.status == "PASS", finding
    if len(lengths) < 2:
        return
    # The last epoch reads one sample of another source in place of one of source d.
    d = next(i for i, c in enumerate(counts) if c)
    other = (d + 1) % len(lengths)
    bad = [r.copy() for r in reads]
    row = int(np.flatnonzero(rec.mix.source_of(bad[-1]) == d)[0])  # type: ignore[union-attr]
    bad[-1][row] = sum(lengths[:other])
    found = mix_counts(mix_records(bad, lengths, counts))
    assert found.status == "FAIL"
    assert found.detail.startswith(f"epoch {epochs - 1}: ")
    assert f"'s{d}' {counts[d] - 1} (expected {counts[d]}, -1)" in found.detail
    assert f"'s{other}' {counts[other] + 1} (expected {counts[other]}, +1)" in found.detail


def test_stream_findings_catch_a_sample_read_twice_before_the_others_once() -> None:
    # One source of 4 samples, 4 per epoch: each pass a permutation.  Epoch 1 reads
    # sample 0 twice and never sample 3: the counts are right, the stream is not.
    reads = [np.array([2, 0, 3, 1]), np.array([0, 1, 0, 2])]
    rec = mix_records(reads, [4], [4])
    assert mix_counts(rec).status == "PASS"
    dup, miss = stream_duplicates(rec), stream_missing(rec)
    assert (dup.status, dup.value) == ("FAIL", 1)
    assert dup.detail == "epoch 1: 's0': 1 extra reads (at most 2x each by now)"
    assert (miss.status, miss.value) == ("FAIL", 1)
    assert miss.detail == "epoch 1: 's0': 1 reads short (at least 2x each by now)"


def test_padding_repeats_are_allowed_up_to_world_size_minus_one() -> None:
    # 5 samples per epoch over 2 ranks: 1 padding repeat of the first position.
    reads = [np.array([0, 1, 2, 3, 4, 0])]
    rec = mix_records(reads, [3, 2], [3, 2], world_size=2)
    found = mix_counts(rec)
    assert found.status == "PASS"
    assert found.detail.endswith("epoch 0: +1 padding repeat(s)")
    assert stream_duplicates(rec).status == "WARN"
    # Without a second rank the same repeat is not padding.
    assert mix_counts(mix_records(reads, [3, 2], [3, 2])).status == "FAIL"


# ---- real audits ---------------------------------------------------------------------
def correct_mix() -> evenly.Dataset[Any]:
    mix = evenly.Mix(SOURCES, weights=WEIGHTS, samples_per_epoch=40)
    return evenly.Dataset(mix, shuffle=True, seed=0)


def padded_mix() -> evenly.Dataset[Any]:
    # 41 samples over 2 ranks: one padding repeat per epoch.
    mix = evenly.Mix(SOURCES, weights=WEIGHTS, samples_per_epoch=41)
    return evenly.Dataset(mix, shuffle=True, seed=0)


def dropping_mix() -> evenly.Dataset[Any]:
    # 43 samples in global steps of 8 with drop_last: 3 positions left out per epoch.
    mix = evenly.Mix(SOURCES, weights=WEIGHTS, samples_per_epoch=43)
    return evenly.Dataset(mix, shuffle=True, seed=0, drop_last=True)


class OverSamplingMix(evenly.Mix):
    """A buggy mixture: the positions the plan gives to ``books`` read ``web``."""

    def epoch_order(self, *args: Any, **kwargs: Any) -> Any:
        order: Order = super().epoch_order(*args, **kwargs)

        def buggy(positions: npt.ArrayLike) -> npt.NDArray[np.int64]:
            idx = np.asarray(order(positions), dtype=np.int64).copy()
            books = self.source_of(idx) == 2
            idx[books] = np.asarray(positions, dtype=np.int64)[books] % self.lengths[0]
            return idx

        return buggy


class StuckStreamMix(evenly.Mix):
    """A buggy mixture: every position of ``code`` reads its first sample."""

    def epoch_order(self, *args: Any, **kwargs: Any) -> Any:
        order: Order = super().epoch_order(*args, **kwargs)

        def buggy(positions: npt.ArrayLike) -> npt.NDArray[np.int64]:
            idx = np.asarray(order(positions), dtype=np.int64).copy()
            idx[self.source_of(idx) == 1] = self.lengths[0]
            return idx

        return buggy


def over_sampling_mix() -> evenly.Dataset[Any]:
    return evenly.Dataset(OverSamplingMix(SOURCES, WEIGHTS, 40), shuffle=True, seed=0)


def stuck_stream_mix() -> evenly.Dataset[Any]:
    return evenly.Dataset(StuckStreamMix(SOURCES, WEIGHTS, 40), shuffle=True, seed=0)


FACTORIES = {
    "correct": correct_mix,
    "padded": padded_mix,
    "dropping": dropping_mix,
    "over_sampling": over_sampling_mix,
    "stuck_stream": stuck_stream_mix,
}


@pytest.fixture(scope="module")
def mix_audits() -> dict[str, AuditResult]:
    results = audit_many(
        list(FACTORIES.values()),
        num_workers=WORKERS,
        world_size=WORLD,
        epochs=EPOCHS,
        batch_size=BATCH,
    )
    return dict(zip(FACTORIES, results, strict=True))


def test_a_correct_mix_passes_with_its_counts_in_the_json(
    mix_audits: dict[str, AuditResult],
) -> None:
    result = mix_audits["correct"]
    statuses = {f.name: f.status for f in result.findings}
    assert statuses == {name: "PASS" for name in statuses}
    assert list(statuses)[:3] == ["duplicates", "missing", "mix_counts"]
    assert result.finding("mix_counts").detail == (
        "every epoch: 'web' 20, 'code' 12, 'books' 8 (as mix.counts)"
    )
    payload = json.loads(result.to_json())
    assert payload["mix"]["counts_per_epoch"] == COUNTS
    assert [row["delivered"] for row in payload["mix"]["per_epoch"]] == [COUNTS] * EPOCHS
    # Each stream moves on by its count every epoch.
    assert [row["stream_offsets"] for row in payload["mix"]["per_epoch"]] == [
        {name: e * c for name, c in COUNTS.items()} for e in range(EPOCHS)
    ]
    # Without the per-stream view, 'books' (1 sample, 8 per epoch) would be 7 duplicates
    # and 23 + 7 + 1 = 31 distinct samples would be "missing" 9 of the 40 expected.
    rec = result.records
    assert duplicates(rec).status == "FAIL"
    assert missing(rec).status == "FAIL"


def test_a_padded_mix_passes_and_says_so(mix_audits: dict[str, AuditResult]) -> None:
    result = mix_audits["padded"]
    assert result.ok, result.to_json()
    found = result.finding("mix_counts")
    assert found.status == "PASS"
    assert "epochs 0-2: +1 padding repeat(s)" in found.detail


def test_what_drop_last_leaves_out_is_a_warning_naming_the_sources(
    mix_audits: dict[str, AuditResult],
) -> None:
    result = mix_audits["dropping"]
    found = result.finding("mix_counts")
    assert found.status == "WARN"
    assert found.detail.startswith("epochs 0-2: drop_last left out ")
    # The 3 positions dropped per epoch are stream items the samples never get back.
    assert result.finding("missing").status == "WARN"
    assert "(within what drop_last left out)" in result.finding("missing").detail
    assert result.finding("duplicates").status == "PASS"


def test_a_mix_that_over_samples_a_source_fails_naming_it(
    mix_audits: dict[str, AuditResult],
) -> None:
    result = mix_audits["over_sampling"]
    assert not result.ok
    found = result.finding("mix_counts")
    assert (found.status, found.value) == ("FAIL", 8)
    assert found.detail == ("epochs 0-2: 'web' 28 (expected 20, +8), 'books' 0 (expected 8, -8)")
    rows = json.loads(result.to_json())["mix"]["per_epoch"]
    assert [row["delivered"] for row in rows] == [{"web": 28, "code": 12, "books": 0}] * 3


def test_a_stream_that_repeats_one_sample_fails_duplicates_and_missing(
    mix_audits: dict[str, AuditResult],
) -> None:
    result = mix_audits["stuck_stream"]
    # The counts are right: only the per-stream view sees the bug.
    assert result.finding("mix_counts").status == "PASS"
    dup, miss = result.finding("duplicates"), result.finding("missing")
    assert dup.status == "FAIL"
    # 12 reads of one sample of 7 in epoch 0: at most 2x each (a pass and 5 more).
    assert dup.detail.startswith("epoch 0: 'code': 10 extra reads (at most 2x each by now)")
    assert miss.status == "FAIL"
    assert miss.detail.startswith("epoch 0: 'code': 6 reads short (at least 1x each by now)")


def test_table_and_html_report_show_samples_per_source_and_epoch(
    mix_audits: dict[str, AuditResult], tmp_path: Path
) -> None:
    table = mix_table(mix_audits["over_sampling"])
    assert table is not None
    assert [c.header for c in table.columns] == ["epoch", "web", "code", "books"]
    console = Console(width=100, record=True)
    console.print(table)
    text = console.export_text()
    assert "28 / 20" in text and "0 / 8" in text and "12 / 12" in text
    page = mix_audits["correct"].write_report(tmp_path).read_text(encoding="utf-8")
    assert "Samples per source and epoch" in page
    assert page.count('<td class="PASS">20 / 20</td>') == EPOCHS
    assert page.count('<td class="PASS">8 / 8</td>') == EPOCHS


def test_cells_off_by_padding_are_warnings_and_beyond_it_failures(
    mix_audits: dict[str, AuditResult], tmp_path: Path
) -> None:
    from evenly.audit._coverage import cell_status

    padded = json.loads(mix_audits["padded"].to_json())["mix"]["per_epoch"]
    assert all(row["slack"] == 1 for row in padded)
    statuses = {cell_status(row, n) for row in padded for n in row["delivered"]}
    assert "FAIL" not in statuses and "WARN" in statuses  # the source the repeat came from
    page = mix_audits["padded"].write_report(tmp_path).read_text(encoding="utf-8")
    assert '<td class="WARN">' in page and '<td class="FAIL">' not in page
    over = json.loads(mix_audits["over_sampling"].to_json())["mix"]["per_epoch"]
    assert cell_status(over[0], "web") == "FAIL" and cell_status(over[0], "code") == "PASS"


# ---- weights that change during the run (set_weights) ---------------------------------
#: after batch 2 of epoch 0 (global position 16 of 40), books gets half of the rest
NEW_WEIGHTS = {"web": 1, "code": 1, "books": 2}
CHANGE = [(0, 2, NEW_WEIGHTS)]


class LateWeightsLoader(evenly.DataLoader):
    """A loader that applies new weights only from the next pass on, not the next batch."""

    pending: dict[str, float] | None = None

    def set_weights(self, weights: Any) -> None:
        self.pending = dict(weights)

    def __iter__(self) -> Any:
        if self.pending is not None:
            super().set_weights(self.pending)
            self.pending = None
        return super().__iter__()


def _late(dataset: evenly.Dataset[Any], **kwargs: Any) -> LateWeightsLoader:
    return LateWeightsLoader(dataset, **kwargs)


def late_weights_mix() -> Any:
    from evenly.audit import LoaderFactory

    dataset = correct_mix()
    return LoaderFactory(make=functools.partial(_late, dataset), dataset=dataset)


def test_a_reweighted_run_is_judged_by_the_weights_in_force_resume_included() -> None:
    right, late = audit_many(
        [correct_mix, late_weights_mix],
        num_workers=1,
        world_size=WORLD,
        epochs=2,
        batch_size=BATCH,
        set_weights=CHANGE,
        resume=True,
    )
    statuses = {f.name: f.status for f in right.findings}
    assert statuses == {name: "PASS" for name in statuses}, right.findings
    rows = json.loads(right.to_json())["mix"]["per_epoch"]
    # after position 16 the 24 positions left go 6 / 6 / 12; epoch 1 is 10 / 10 / 20
    assert rows[1]["expected"] == {"web": 10, "code": 10, "books": 20}
    assert rows[0]["expected"]["books"] - 12 == round(16 * 8 / 40)
    assert rows[0]["weight_changes"] == [
        {"position": 16, "weights": {k: float(v) for k, v in NEW_WEIGHTS.items()}}
    ]
    assert [row["delivered"] for row in rows] == [row["expected"] for row in rows]
    # the change one pass late: epoch 0 keeps the old shares, which the audit names
    found = late.finding("mix_counts")
    assert found.status == "FAIL" and found.detail.startswith("epoch 0: 'web' 20 (expected")
    assert "epoch 1" not in found.detail


def test_assert_loader_correct_takes_set_weights_and_names_a_late_change() -> None:
    from evenly.testing import assert_loader_correct

    with pytest.raises(AssertionError, match=r"FAIL Samples per source \(Mix\): epoch 0: 'web' 20"):
        assert_loader_correct(
            "tests.test_audit_mix:late_weights_mix",
            world_size=WORLD,
            num_workers=0,
            batch_size=BATCH,
            resume=False,
            set_weights=CHANGE,
        )
