"""``evenly audit --resume`` and ``evenly.testing``: the comparisons as pure functions,
then real audits (gloo ranks, DataLoader workers) of a zoo of loaders with one resume
defect each (``tests/zoo.py``), of evenly under other topologies, and of the test helper.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from evenly.audit import AuditResult, Finding, audit_many
from evenly.audit._junit import junit_xml
from evenly.audit._report import image_size
from evenly.audit._resume import choose_stops
from evenly.audit._resumecheck import Run, check_stop, prefix_matches
from evenly.testing import Topology, assert_loader_correct, topologies

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # the rank processes inherit sys.path

import examples.talk_attempts as talk  # noqa: E402

from tests import zoo  # noqa: E402


# ---- pure comparisons -------------------------------------------------------------------
def _run(
    per_rank: list[list[int]], *, batch: int, seg: int = 0, epoch: int = 0, first_batch: int = 0
) -> Run:
    """Rows of each rank's samples, in batches of ``batch``."""
    cols: dict[str, list[int]] = {k: [] for k in ("ids", "rank", "epoch", "batch", "pos", "seg")}
    for r, ids in enumerate(per_rank):
        for i, x in enumerate(ids):
            for k, v in zip(
                cols, (x, r, epoch, first_batch + i // batch, i % batch, seg), strict=True
            ):
                cols[k].append(v)
    return Run.of(world_size=len(per_rank), **cols)


def _split_at(ref_ranks: list[list[int]], stop: int, batch: int, world: int = 0) -> Run:
    """The reference cut after ``stop`` batches per rank and resumed (same topology)."""
    before = _run([r[: stop * batch] for r in ref_ranks], batch=batch, seg=0)
    after = _run([r[stop * batch :] for r in ref_ranks], batch=batch, seg=1, first_batch=stop)
    return Run.concat([before, after], world or len(ref_ranks))


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(2, 40),
    world=st.integers(1, 3),
    batch=st.integers(1, 4),
    stop_frac=st.floats(0, 1),
    seed=st.integers(0, 2**16),
)
def test_a_run_cut_anywhere_and_resumed_exactly_has_no_problem_and_one_lost_sample_is_missing(
    n: int, world: int, batch: int, stop_frac: float, seed: int
) -> None:
    perm = [int(x) for x in np.random.default_rng(seed).permutation(n)]
    ranks = [perm[r::world] for r in range(world)]
    ref = _run(ranks, batch=batch)
    stop = int(stop_frac * (len(ranks[-1]) // batch))
    got = _split_at(ranks, stop, batch)
    assert prefix_matches(ref, got)
    assert check_stop(ref, got, batch_size=batch).problems == []
    lost = _split_at([r[:-1] if i == 0 else r for i, r in enumerate(ranks)], stop, batch)
    problems = check_stop(ref, lost, batch_size=batch).problems
    assert problems and "1 missing" in problems[0]


def test_check_stop_names_repeats_reorders_and_a_wrong_epoch() -> None:
    ranks = [[0, 1, 2, 3, 4, 5]]
    ref = _run(ranks, batch=2)
    repeated = Run.concat([_run([[0, 1, 2, 3]], batch=2), _run([[2, 3, 4, 5]], batch=2, seg=1)], 1)
    assert check_stop(ref, repeated, batch_size=2).problems == ["epoch 0: 2 repeated (e.g. 2, 3)"]
    swapped = Run.concat([_run([[0, 1]], batch=2), _run([[4, 5, 2, 3]], batch=2, seg=1)], 1)
    (problem,) = check_stop(ref, swapped, batch_size=2).problems
    assert "rank 0 reordered from its sample 2" in problem
    two = Run.concat([ref, _run([[5, 4, 3, 2, 1, 0]], batch=2, epoch=1)], 1)
    replayed = Run.concat([ref, _run([[0, 1, 2, 3, 4, 5]], batch=2, epoch=1, seg=1)], 1)
    (problem,) = check_stop(two, replayed, batch_size=2).problems
    assert problem == "epoch 1: wrong epoch, delivered epoch 0's order"
    skipped = check_stop(two, ref, batch_size=2).problems
    assert skipped == ["epoch 1: nothing delivered (the epoch was skipped)"]


def test_check_stop_under_another_world_size_allows_the_new_padding_only() -> None:
    ref = _run([[0, 2, 4], [1, 3, 0]], batch=1)  # 5 samples on 2 ranks: one pad
    got = Run.concat(
        [_run([[0], [1]], batch=1), _run([[2], [3], [4]], batch=1, seg=1, first_batch=1)], 3
    )
    assert check_stop(ref, got, batch_size=1).problems == []
    padded = Run.concat([got, _run([[0], [1], [2]], batch=1, seg=1, first_batch=2)], 3)
    assert check_stop(ref, padded, batch_size=1).problems == []  # 2 repeats: a new padding
    many = Run.concat([got, _run([[1, 2], [3], [4]], batch=1, seg=1, first_batch=2)], 3)
    (problem,) = check_stop(ref, many, batch_size=1).problems
    assert "4 repeated" in problem and "beyond the 2 a new padding may need" in problem


def test_a_run_that_differs_before_the_stop_is_compared_by_counts_only() -> None:
    ref = _run([[0, 1, 2, 3]], batch=2)
    other = Run.concat([_run([[1, 0]], batch=2), _run([[3, 2]], batch=2, seg=1)], 1)
    assert not prefix_matches(ref, other)
    check = check_stop(ref, other, batch_size=2, reproducible=False)
    assert check.problems == [] and "not reproducible between runs" in check.notes[0]


def test_choose_stops_covers_early_middle_last_boundary_and_a_second_resume() -> None:
    stops = {s.name: s for s in choose_stops([9, 8], 2, at=(0.5,))}
    assert [(s.epoch, s.batch, s.end_of_pass) for s in stops.values()] == [
        (0, 1, False),
        (0, 4, False),
        (0, 9, False),
        (0, 9, True),
        (0, 3, False),
        (0, 4, False),
    ]
    second = stops["second resume"].then
    assert second is not None and (second.epoch, second.batch) == (1, 4)
    assert choose_stops([0], 2) == []
    one_epoch = choose_stops([4], 1)
    assert "epoch boundary" not in {s.name for s in one_epoch}
    assert [s.then.batch for s in one_epoch if s.then] == [2]


@settings(max_examples=30, deadline=None)
@given(topologies())
def test_topologies_give_valid_audit_arguments(topology: Topology) -> None:
    kw = topology.kwargs()
    assert 1 <= kw["world_size"] <= 3 and 1 <= kw["resume_world_size"] <= 3
    assert 0 <= kw["num_workers"] <= 2 and 0 <= kw["resume_workers"] <= 2
    assert kw["batch_size"] in (1, 2, 4, 8)
    assert all(0 < f <= 1 for f in kw["resume_at"])


def test_junit_xml_has_one_case_per_finding_and_a_failure_per_fail() -> None:
    found = [
        Finding("missing", "Missing", "PASS", 0, "none"),
        Finding("resume_early", "Resume: early", "FAIL", 0, "epoch 0: 2 missing (e.g. 1, 2)"),
        Finding("resume", "Resume", "WARN", 0, "cannot resume: no state"),
    ]
    root = ET.fromstring(junit_xml([("tests.zoo:zoo", found)]))
    (suite,) = root.findall("testsuite")
    assert (suite.get("tests"), suite.get("failures")) == ("3", "1")
    cases = {c.get("name"): c for c in suite.findall("testcase")}
    assert list(cases) == ["missing", "resume_early", "resume"]
    failure = cases["resume_early"].find("failure")
    assert failure is not None and failure.get("message") == "epoch 0: 2 missing (e.g. 1, 2)"
    assert cases["resume"].find("failure") is None
    assert "cannot resume" in (cases["resume"].findtext("system-out") or "")


# ---- real audits ------------------------------------------------------------------------
def _resume_status(result: AuditResult) -> dict[str, str]:
    return {f.name: f.status for f in result.findings if f.name.startswith("resume_")}


def test_the_resume_audit_finds_each_defect_of_the_zoo() -> None:
    names = [None, *zoo.DEFECTS]
    factories = [functools.partial(zoo.zoo, d) for d in names]
    factories += [zoo.stream, functools.partial(talk.distributed_sampler, size=48)]
    factories += [functools.partial(zoo.zoo, "unloadable")]
    results = audit_many(
        factories, num_workers=1, world_size=2, epochs=2, batch_size=4, resume=True
    )
    by = dict(zip([*names, "stream", "sampler", "unloadable"], results, strict=True))
    for right in (None, "stream"):
        assert set(_resume_status(by[right]).values()) == {"PASS"}, by[right].findings
        assert by[right].finding("resume").status == "PASS"
    expect = {
        "forgets_position": ("resume_early", "repeated"),
        "loses_buffered": ("resume_early", "missing"),
        "repeats_prefetched": ("resume_middle", "repeated"),
        "skips_epoch": ("resume_epoch_boundary", "wrong epoch"),
        "stale_offset": ("resume_second_resume", "repeated"),
        "len_left": ("resume_middle", "len(loader) was 3 after loading the state, not the 3"),
        "splits_last_batch": ("resume_early", "after the load: batches per rank [6, 7]"),
    }
    for defect, (stop, word) in expect.items():
        found = by[defect].finding(stop)
        assert found.status == "FAIL" and word in found.detail, (defect, found)
        assert not by[defect].ok
    # the defects that only show at one stop pass at every other
    for defect in ("skips_epoch", "stale_offset"):
        statuses = _resume_status(by[defect])
        assert [k for k, v in statuses.items() if v == "FAIL"] == [expect[defect][0]]
    cannot = by["sampler"].finding("resume")
    assert cannot.status == "WARN" and "cannot resume" in cannot.detail
    assert by["sampler"].ok  # a warning, not a defect
    refused = by["unloadable"]
    assert refused.ok and refused.finding("resume").status == "WARN"
    assert "at no stop" in refused.finding("resume").detail
    for name in _resume_status(refused):
        found = refused.finding(name)
        assert found.status == "WARN" and "another version" in found.detail, found


def test_the_resume_audit_passes_evenly_onto_more_ranks_and_workers(tmp_path: Path) -> None:
    evenly_result, ranked = audit_many(
        [functools.partial(zoo.evenly_dataset, 60), functools.partial(zoo.zoo, "rank_state")],
        num_workers=1,
        world_size=2,
        epochs=2,
        batch_size=4,
        resume=True,
        resume_world_size=3,
        resume_workers=2,
    )
    statuses = _resume_status(evenly_result)
    assert len(statuses) == 5 and set(statuses.values()) == {"PASS"}, evenly_result.findings
    assert "onto 3 ranks x 2 workers" in evenly_result.finding("resume").detail
    topology = ranked.finding("resume")
    assert topology.status == "WARN"
    assert "cannot resume onto another topology" in topology.detail
    assert set(_resume_status(ranked).values()) == {"PASS"}  # resumed on its 2 ranks
    page = evenly_result.write_report(tmp_path)
    text = page.read_text()
    assert "Resume: what each rank delivered before and after each interruption" in text
    assert "3 x 2" in text  # the stops' topology, in the resume table
    from PIL import Image

    with Image.open(tmp_path / "resume.png") as img:
        assert img.size == image_size("resume", 1)


def test_the_cli_resume_exit_status_and_junit(tmp_path: Path) -> None:
    junit = tmp_path / "audit.xml"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "evenly.audit",
            "tests.zoo:zoo",
            "tests.zoo:forgets_position",
            "--resume",
            "--workers",
            "0",
            "--world-size",
            "2",
            "--batch-size",
            "4",
            "--junit",
            str(junit),
            "--json",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert run.returncode == 1, run.stderr  # a defect: exit status 1
    right, broken = json.loads(run.stdout)
    assert right["ok"] and not broken["ok"]
    suites = ET.parse(junit).getroot().findall("testsuite")
    assert [s.get("name") for s in suites] == ["tests.zoo:zoo", "tests.zoo:forgets_position"]
    assert suites[0].get("failures") == "0" and int(suites[1].get("failures") or 0) >= 1
    failed = {c.get("name") for c in suites[1].findall("testcase") if c.find("failure") is not None}
    assert "resume_early" in failed


def test_assert_loader_correct_passes_evenly_resumed_onto_one_rank_without_workers() -> None:
    result = assert_loader_correct(
        "tests.zoo:evenly_dataset",
        world_size=2,
        num_workers=2,
        batch_size=4,
        resume_world_size=1,
        resume_workers=0,
        resume_at=(0.4,),
    )
    assert "onto 1 ranks x 0 workers" in result.finding("resume").detail
    assert result.finding("resume_at_0_4").status == "PASS"


def test_assert_loader_correct_raises_with_the_findings_of_a_broken_loader() -> None:
    with pytest.raises(AssertionError, match=r"(?s)examples\.talk_attempts:naive.*FAIL Duplicates"):
        assert_loader_correct(
            "examples.talk_attempts:naive", world_size=2, num_workers=1, resume=False
        )


def test_the_pytest_plugin_gives_the_assert_loader_fixture(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["evenly.testing"]\n')
    (tmp_path / "test_uses_it.py").write_text(
        "from evenly.testing import assert_loader_correct\n\n"
        "def test_fixture(assert_loader):\n"
        "    assert assert_loader is assert_loader_correct\n"
    )
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "1 passed" in run.stdout
