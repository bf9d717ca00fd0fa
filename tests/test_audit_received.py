"""The audit records what the training loop received, and judges a Mix's order by what
the Mix promises.

- A ``collate_fn`` that drops the last sample of every batch loses samples in every
  epoch: the audit records the batches after collate (the ids they hold), so it FAILs
  naming the samples read but never received.  For packed rows, the tokens the collated
  ``input_ids`` hold: a row zeroed by the collate is its tokens missing.
- An ``evenly.Mix`` by samples is apportioned on ``world_size x batch_size`` steps, so
  its order after a resume onto 3 ranks is another one by design (docs/mixtures.md):
  exactly once and each source's share are what is judged there, not the order; a Mix
  that loses a batch after the load still FAILs, for what it lost.

Real audits: gloo rank processes with DataLoader workers, launched by the audit (the CLI,
``evenly.audit.run`` and ``evenly.testing.assert_loader_correct``).
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DistributedSampler, default_collate

import evenly
from evenly.audit import LoaderFactory, run
from evenly.audit._collect import RankResult
from evenly.audit._coverage import coverage
from evenly.audit._resume import resumed_shares
from evenly.audit._sourceinfo import mix_info
from evenly.audit._trace import MetaBatch, batch_ids, default_id, received
from evenly.audit._types import Settings
from evenly.testing import assert_loader_correct

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # the rank processes inherit sys.path

from tests import zoo_packed  # noqa: E402

SIZE, WORLD, BATCH, EPOCHS = 40, 2, 4, 2
SOURCES = {"web": list(range(23)), "code": list(range(100, 107)), "books": [200]}
WEIGHTS = {"web": 5, "code": 3, "books": 2}


# ---- factories (module level: the rank processes import them) ---------------------------
def drop_last_sample(samples: list[Any]) -> Any:
    """A collate_fn with a bug: the last sample of every batch never reaches the loop."""
    return default_collate(samples[:-1])


def dropping_collate() -> tuple[evenly.Dataset[Any], dict[str, Any]]:
    return evenly.Dataset(list(range(SIZE)), shuffle=True, seed=0), {"collate_fn": drop_last_sample}


def sampled_dropping_collate() -> tuple[list[int], dict[str, Any]]:
    """The same bug under a map-style dataset with torch's DistributedSampler."""
    data = list(range(SIZE))
    sampler = DistributedSampler(data, shuffle=True, seed=0)  # type: ignore[var-annotated]
    return data, {"sampler": sampler, "collate_fn": drop_last_sample}


def zero_last_row(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """A collate_fn with a bug: the last packed row of every batch is zeroed."""
    batch: dict[str, torch.Tensor] = default_collate(rows)
    batch["input_ids"][-1] = 0
    return batch


def zeroed_packed_row() -> tuple[evenly.Dataset[Any], dict[str, Any]]:
    return zoo_packed.packed(), {"collate_fn": zero_last_row}


def mix() -> evenly.Dataset[Any]:
    """Right: 40 samples per epoch, web 20, code 12, books 8."""
    return evenly.Dataset(evenly.Mix(SOURCES, weights=WEIGHTS, samples_per_epoch=40), seed=0)


def dropping_mix() -> tuple[evenly.Dataset[Any], dict[str, Any]]:
    return mix(), {"collate_fn": drop_last_sample}


class LosesBatchAfterLoad(evenly.DataLoader):
    """A loader with a resume bug: the first batch after a load is lost (as a prefetched
    batch that is neither delivered nor replayed)."""

    lose = False

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.lose = True

    def __iter__(self) -> Any:
        batches = super().__iter__()
        if self.lose:
            self.lose = False
            next(batches, None)
        return batches


def _losing(dataset: evenly.Dataset[Any], **kwargs: Any) -> LosesBatchAfterLoad:
    return LosesBatchAfterLoad(dataset, **kwargs)


def losing_mix() -> LoaderFactory:
    dataset = mix()
    return LoaderFactory(make=functools.partial(_losing, dataset), dataset=dataset)


# ---- what the loop received -------------------------------------------------------------
def _named(detail: str, epoch: int) -> list[int]:
    """The ids a ``missing`` detail names as read but not received in ``epoch``."""
    part = next(p for p in detail.split("; ") if p.startswith(f"epoch {epoch}:"))
    return [int(v) for v in re.findall(r"\d+", part.split("returned: ")[1])]


def test_the_cli_fails_a_collate_fn_that_drops_samples_naming_them() -> None:
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "evenly.audit",
            "tests.test_audit_received:dropping_collate",
            "tests.test_audit_received:dropping_mix",
            "--workers",
            "1",
            "--world-size",
            str(WORLD),
            "--epochs",
            str(EPOCHS),
            "--batch-size",
            str(BATCH),
            "--json",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert run.returncode == 1, run.stderr  # samples lost: exit status 1
    plain, mixed = json.loads(run.stdout)
    found = {f["name"]: f for f in plain["findings"]}
    # 2 ranks x 5 batches of 4 per epoch, one sample of each batch dropped: 10 of 40
    lost = SIZE // BATCH
    missing = found["missing"]
    assert missing["status"] == "FAIL", missing
    for epoch in range(EPOCHS):
        assert (
            f"epoch {epoch}: {lost} of {SIZE} never delivered ({SIZE - lost} seen, {lost} read "
            f"but not in the batches collate_fn returned: " in missing["detail"]
        ), missing["detail"]
        named = _named(missing["detail"], epoch)
        assert len(named) == 5 and len(set(named)) == 5 and set(named) <= set(range(SIZE))
    assert found["length"]["status"] == "FAIL"  # len() 20 per rank, 15 received
    # a Mix by samples with the same collate: each source's share is short
    counts = {f["name"]: f for f in mixed["findings"]}["mix_counts"]
    assert counts["status"] == "FAIL" and "(expected 20, -" in counts["detail"], counts


def test_assert_loader_correct_fails_a_dropping_collate_under_a_distributed_sampler() -> None:
    with pytest.raises(AssertionError) as raised:
        assert_loader_correct(
            "tests.test_audit_received:sampled_dropping_collate",
            world_size=WORLD,
            num_workers=1,
            epochs=EPOCHS,
            batch_size=BATCH,
            resume=False,
        )
    text = str(raised.value)
    assert "FAIL Missing (vs len(dataset)): epoch 0: 10 of 40 never delivered" in text, text
    assert "read but not in the batches collate_fn returned: " in text


def _last_row_tokens() -> dict[int, int]:
    """Per epoch, the tokens of every batch's last row over both ranks (what the zeroing
    collate takes away), counted here from the dataset's own rows in one process."""
    out = dict.fromkeys(range(EPOCHS), 0)
    for rank in range(WORLD):
        loader = evenly.DataLoader(
            zoo_packed.packed(rank=rank, world_size=WORLD),
            batch_size=BATCH,
            collate_fn=list,
            agreement_timeout=None,
        )
        for epoch in range(EPOCHS):
            loader.set_epoch(epoch)
            for rows in loader:
                out[epoch] += int((rows[-1]["input_ids"] != 0).sum())
    return out


def test_a_collate_fn_that_zeroes_a_packed_row_fails_naming_its_tokens() -> None:
    with pytest.warns(evenly.EvenlyWarning, match="pad row"):
        lost = _last_row_tokens()
    result = run(
        "tests.test_audit_received:zeroed_packed_row",
        world_size=WORLD,
        num_workers=1,
        epochs=EPOCHS,
        batch_size=BATCH,
    )
    tokens = result.finding("tokens")
    assert tokens.status == "FAIL" and not result.ok, tokens
    for epoch in range(EPOCHS):
        assert f"epoch {epoch}: {lost[epoch]} tokens missing (document " in tokens.detail, (
            lost,
            tokens.detail,
        )
    assert "tokens repeated" not in tokens.detail


def test_received_rows_cuts_a_piece_at_a_changed_token_and_names_only_that_token() -> None:
    rows = [{"input_ids": torch.tensor([10, 11, 12, 20, 21])}]
    # one row: document 1 tokens [3, 6) then document 2 tokens [0, 2)
    pieces = np.array([[0, 1, 3, 3], [0, 2, 0, 2]], dtype=np.int64)
    metas = MetaBatch.of([(0, 1, 0.1, 0.2, 0.3, -1)])._replace(pieces=pieces)
    batch = {"input_ids": torch.tensor([[10, 99, 12, 20, 21]])}  # token 4 of document 1 lost
    kept = received(batch, rows, metas, default_id).pieces
    assert kept is not None and kept.tolist() == [[0, 1, 3, 1], [0, 1, 5, 1], [0, 2, 0, 2]]
    (found,) = coverage(
        lengths=np.array([0, 6, 2]),
        epochs=1,
        epoch=np.zeros(4, dtype=np.int64),
        rank=np.zeros(4, dtype=np.int64),
        doc=np.r_[1, kept[:, 1]],
        start=np.r_[0, kept[:, 2]],
        length=np.r_[3, kept[:, 3]],
    )
    assert found.text.startswith("1 token missing (document 1 tokens [4, 5)"), found.text
    # a collate_fn that leaves a row out: that row's pieces are gone, the others follow
    two = [rows[0], {"input_ids": torch.tensor([30, 31, 0, 0, 0])}]
    both = np.r_[pieces, [[1, 3, 0, 2]]].astype(np.int64)
    metas = MetaBatch.of([(0, 1, 0.1, 0.2, 0.3, -1), (0, 2, 0.4, 0.5, 0.6, -1)])
    left = received(
        {"input_ids": two[1]["input_ids"][None]}, two, metas._replace(pieces=both), default_id
    )
    assert left.samples == 1 and left.ids.tolist() == [2]
    assert left.pieces is not None and left.pieces.tolist() == [[0, 3, 0, 2]]


def test_ids_are_read_back_from_the_batch_the_collate_fn_returned() -> None:
    assert batch_ids(torch.tensor([3, 4]), default_id) == [3, 4]
    assert batch_ids({"idx": torch.tensor([3, 4]), "x": torch.zeros(2, 7)}, default_id) == [3, 4]
    assert batch_ids(["a", "b"], default_id) == ["a", "b"]
    by_label = batch_ids([torch.zeros(2, 5), torch.tensor([7, 8])], lambda s: s[1])
    assert by_label == [7, 8]
    metas = MetaBatch.of([(0, i, 0.1, 0.2, 0.3, -1) for i in (5, 6, 7)])
    dropped = received(torch.tensor([5, 6]), [5, 6, 7], metas, default_id)
    assert dropped.ids.tolist() == [5, 6] and dropped.dropped == [7]
    twice = received(torch.tensor([5, 5, 6, 7]), [5, 6, 7], metas, default_id)
    assert twice.ids.tolist() == [5, 5, 6, 7] and not twice.dropped
    # features that name no sample read: kept as read, with the reason
    features = received(torch.tensor([0.5, 0.25, 1.5]), [5, 6, 7], metas, default_id)
    assert features.ids.tolist() == [5, 6, 7] and features.unread


# ---- a Mix's topology-dependent order -----------------------------------------------------
def test_a_mix_resumed_onto_three_ranks_passes_judged_by_exactly_once_and_shares() -> None:
    result = assert_loader_correct(
        "tests.test_audit_received:mix",
        world_size=WORLD,
        num_workers=1,
        epochs=EPOCHS,
        batch_size=BATCH,
        resume_world_size=3,
    )
    assert "onto 3 ranks x 1 workers" in result.finding("resume").detail
    stops = [f for f in result.findings if f.name.startswith("resume_")]
    assert len(stops) == 5
    for stop in stops:
        assert stop.status == "PASS", stop
        assert "exactly-once and samples per source, not by order" in stop.detail, stop


def test_a_mix_that_loses_a_batch_after_a_resume_onto_three_ranks_fails_for_what_it_lost() -> None:
    result = run(
        losing_mix,
        world_size=WORLD,
        num_workers=1,
        epochs=EPOCHS,
        batch_size=BATCH,
        resume=True,
        resume_world_size=3,
    )
    assert all(f.status == "PASS" for f in result.findings if not f.name.startswith("resume")), (
        result.findings
    )
    early = result.finding("resume_early")
    assert early.status == "FAIL" and not result.ok, early
    assert re.search(r"epoch 0: \d+ missing \(e\.g\. ", early.detail), early.detail
    assert "reordered" not in early.detail and "wrong epoch" not in early.detail, early.detail
    # the epoch-boundary stop resumes at a pass start: its lost batch is epoch 1's first
    boundary = result.finding("resume_epoch_boundary")
    assert boundary.status == "FAIL" and "epoch 1: " in boundary.detail, boundary


def test_a_resumed_mix_reading_one_source_in_place_of_another_fails_its_shares() -> None:
    info = mix_info(mix(), Settings(num_workers=0, world_size=WORLD, epochs=1, batch_size=BATCH))
    assert info is not None and info.counts == (20, 12, 8)
    # global indices: web 0-22, code 23-29, books 30; a source's reads in one epoch
    right = np.r_[np.arange(20), np.arange(23, 30), np.arange(23, 28), np.full(8, 30)]
    wrong = right.copy()
    wrong[20:22] = [20, 21]  # two of code's reads are web's: the same 40 samples in all

    def run(reads: np.ndarray) -> list[RankResult]:
        zeros = np.zeros(len(reads), dtype=np.int64)
        return [RankResult(rank=0, reads=reads.astype(np.int64), epoch=zeros)]

    step = 3 * BATCH
    assert resumed_shares(info, run(right), [run(right)], 1, step) == []
    assert resumed_shares(info, run(right), [run(wrong)], 1, step) == [
        "epoch 0: samples per source 'web' 22 (20 uninterrupted), 'code' 10 (12 uninterrupted)"
    ]
