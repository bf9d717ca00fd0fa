"""``evenly audit``: findings as pure functions of synthetic records, then real audits of
the talk's attempts (real rank processes with gloo, real DataLoader workers).

The real audits share one group of rank processes (``audit_many``) to keep this file
fast: 2 ranks x 2 workers x 2 epochs, batch size 10, 100-202 samples.
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from evenly.audit import AuditError, AuditResult, Records, audit_many, default_id, run
from evenly.audit._api import _encode, build_records
from evenly.audit._collect import RankResult, Settings, resolve
from evenly.audit._coverage import duplicates, missing
from evenly.audit._findings import compact, length, partial_batches, rank_balance, rng_streams
from evenly.audit._shuffle import adjacency, repeated_order, shuffle_quality, spearman
from evenly.audit._types import RankEpoch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # the rank processes inherit sys.path

import examples.talk_attempts as talk  # noqa: E402


def records(
    ids: list[int] | np.ndarray,
    *,
    rank: list[int] | np.ndarray | None = None,
    worker: list[int] | np.ndarray | None = None,
    epoch: list[int] | np.ndarray | None = None,
    batch_size: int = 4,
    world_size: int = 1,
    num_workers: int = 1,
    epochs: int = 1,
    expected: int | None = None,
    draws: np.ndarray | None = None,
    per_rank: list[RankEpoch] | None = None,
    shards: np.ndarray | None = None,
) -> Records:
    """Rows in delivery order; batches of ``batch_size`` per (rank, epoch)."""
    n = len(ids)
    zeros = np.zeros(n, dtype=np.int64)
    rank_a = zeros if rank is None else np.asarray(rank, dtype=np.int64)
    epoch_a = zeros if epoch is None else np.asarray(epoch, dtype=np.int64)
    index = np.zeros(n, dtype=np.int64)
    for key in set(zip(rank_a.tolist(), epoch_a.tolist(), strict=True)):
        rows = np.flatnonzero((rank_a == key[0]) & (epoch_a == key[1]))
        index[rows] = np.arange(len(rows))
    return Records(
        ids=np.asarray(ids, dtype=np.int64),
        rank=rank_a,
        worker=zeros if worker is None else np.asarray(worker, dtype=np.int64),
        epoch=epoch_a,
        batch=index // batch_size,
        pos=index % batch_size,
        draws=np.random.default_rng(n).random((n, 3)) if draws is None else draws,
        per_rank=per_rank or [],
        world_size=world_size,
        num_workers=num_workers,
        epochs=epochs,
        batch_size=batch_size,
        expected=expected,
        shards=shards,
    )


def test_duplicates_counts_every_extra_delivery() -> None:
    found = duplicates(records(list(range(10)) * 3, expected=10))
    assert (found.status, found.value) == ("FAIL", 20)
    assert "every sample delivered 3x" in found.detail


def test_duplicates_uneven_and_padding() -> None:
    found = duplicates(records([0, 1, 1, 2, 2, 2]))
    assert (found.status, found.value) == ("FAIL", 3)
    assert "2 samples delivered more than once (up to 3x)" in found.detail
    padded = duplicates(records([0, 1, 2, 0], world_size=2))
    assert (padded.status, padded.value) == ("WARN", 1)
    assert duplicates(records([3, 1, 2, 0])).status == "PASS"


def test_missing_against_expected_and_union() -> None:
    assert (missing(records(list(range(8)), expected=10)).value) == 2
    assert missing(records(list(range(8)), expected=10)).status == "FAIL"
    assert missing(records(list(range(12)), expected=10)).status == "FAIL"
    assert missing(records(list(range(10)), expected=10)).status == "PASS"
    # Without an expected count, the union of all epochs stands in for it.
    rec = records([0, 1, 2, 3, 0, 1], epoch=[0, 0, 0, 0, 1, 1], epochs=2)
    found = missing(rec)
    assert (found.status, found.value) == ("FAIL", 2)
    assert "epoch 1: 2 of 4 never delivered" in found.detail


def _per_rank(batches: list[int], samples: list[int]) -> list[RankEpoch]:
    return [
        RankEpoch(r, 0, s, b, s, b) for r, (b, s) in enumerate(zip(batches, samples, strict=True))
    ]


def test_rank_balance_unequal_batches_is_a_hang_risk() -> None:
    rec = records([0], world_size=2, per_rank=_per_rank([12, 10], [102, 100]))
    found = rank_balance(rec)
    assert (found.status, found.value) == ("FAIL", 2)
    assert "[12, 10]" in found.detail and "hang" in found.detail
    rec = records([0], world_size=2, per_rank=_per_rank([10, 10], [100, 98]))
    assert rank_balance(rec).status == "WARN"
    rec = records([0], world_size=2, per_rank=_per_rank([10, 10], [100, 100]))
    assert rank_balance(rec).status == "PASS"


def test_partial_batches_one_per_rank_is_fine_more_is_ragged() -> None:
    ragged = records(list(range(12)), worker=[0] * 4 + [1] * 4 + [0] * 2 + [1] * 2)
    # Batches as a worker-batched loader gives them: 4, 4, 2, 2.
    ragged.batch[:] = [0] * 4 + [1] * 4 + [2] * 2 + [3] * 2
    found = partial_batches(ragged)
    assert (found.status, found.value) == ("WARN", 2)
    assert partial_batches(records(list(range(10)))).status == "PASS"  # 4, 4, 2


def test_spearman_matches_scipy_reference() -> None:
    # scipy.stats.spearmanr([1, 2, 3, 4, 5], [5, 6, 7, 8, 7]).statistic
    assert spearman([1, 2, 3, 4, 5], [5, 6, 7, 8, 7]) == pytest.approx(0.8207826816681233)
    assert spearman([1, 1, 1], [1, 2, 3]) == 0.0


def test_shuffle_quality_sorted_vs_permuted() -> None:
    found = shuffle_quality(records(list(range(1000))))
    assert (found.status, found.value) == ("WARN", 1.0)
    assert "displacement 0.00 of random" in found.detail
    perm = np.random.default_rng(1).permutation(1000)
    assert shuffle_quality(records(perm)).status == "PASS"


def test_adjacency_flags_shard_local_batches() -> None:
    ids = np.arange(400)
    shards = ids // 100
    blocky = adjacency(records(ids, batch_size=10, shards=shards))
    assert blocky.status == "WARN"
    assert blocky.value == pytest.approx(1 / (4 * 99 * 100 / (400 * 399)), rel=1e-3)
    perm = np.random.default_rng(2).permutation(400)
    assert adjacency(records(perm, batch_size=10, shards=perm // 100)).status == "PASS"


def test_repeated_order_fails_only_for_a_repeated_shuffle() -> None:
    perm = np.random.default_rng(3).permutation(200)
    rec = records(np.r_[perm, perm], epoch=[0] * 200 + [1] * 200, epochs=2)
    found = repeated_order(rec)
    assert (found.status, found.value) == ("FAIL", 1)
    plain = records(np.r_[np.arange(200), np.arange(200)], epoch=[0] * 200 + [1] * 200, epochs=2)
    assert repeated_order(plain).status == "WARN"
    other = np.random.default_rng(4).permutation(200)
    moved = records(np.r_[perm, other], epoch=[0] * 200 + [1] * 200, epochs=2)
    assert repeated_order(moved).status == "PASS"


def test_rng_streams_shared_across_workers_fail_across_epochs_warn() -> None:
    same = np.tile(np.random.default_rng(5).random((10, 3)), (2, 1))
    found = rng_streams(records(np.arange(20), worker=[0] * 10 + [1] * 10, draws=same))
    assert (found.status, found.value) == ("FAIL", 1)
    assert "equal across workers (random/numpy/torch)" in found.detail
    epochs = rng_streams(records(np.arange(20), epoch=[0] * 10 + [1] * 10, epochs=2, draws=same))
    assert epochs.status == "WARN" and "across epochs" in epochs.detail
    assert rng_streams(records(np.arange(20), worker=[0] * 10 + [1] * 10)).status == "PASS"


def test_length_compares_len_with_what_was_yielded() -> None:
    lie = [RankEpoch(0, 0, 200, 20, 100, 10)]
    found = length(records([0], per_rank=lie))
    assert (found.status, found.value) == ("FAIL", 100)
    assert "len() 100, yielded 200" in found.detail
    assert length(records([0], per_rank=[RankEpoch(0, 0, 5, 2, None, None)])).status == "WARN"
    assert length(records([0], per_rank=[RankEpoch(0, 0, 5, 2, 5, 2)])).status == "PASS"


def test_compact_merges_repeated_parts() -> None:
    assert compact("epoch 0: a; epoch 1: a; epoch 3: a") == "epochs 0,1,3: a"
    text = "rank 0 epoch 0: x; rank 1 epoch 0: x; rank 0 epoch 1: x; rank 1 epoch 1: x"
    assert compact(text) == "ranks 0-1 epochs 0-1: x"
    assert compact("rank 0 epoch 0: x; rank 1 epoch 1: x") == text.split("; ", 1)[0] + (
        "; rank 1 epoch 1: x"
    )
    assert compact("nothing to merge") == "nothing to merge"


def test_default_id() -> None:
    assert default_id(torch.tensor([5])) == 5
    assert default_id(np.int32(4)) == 4
    assert default_id({"idx": torch.tensor(2), "image": None}) == 2
    with pytest.raises(TypeError, match=r"cannot tell which sample.*id_fn"):
        default_id((1, 2))


def test_resolve_names_what_is_wrong() -> None:
    with pytest.raises(AuditError, match="cannot import module 'no_such_mod_xyz'"):
        resolve("no_such_mod_xyz:f")
    with pytest.raises(AuditError, match=r"module 'os\.path' has no attribute 'nope'"):
        resolve("os.path:nope")
    with pytest.raises(AuditError, match=r"module\.path:attribute"):
        resolve("os.path.join")


def test_build_records_encodes_string_ids_and_shards() -> None:
    codes, labels, _ = _encode(["b/2", "a/1", "b/2"])
    assert codes.tolist() == [1, 0, 1] and labels == ["a/1", "b/2"]
    result = RankResult(
        rank=0,
        ids=["b/2", "a/1"],
        worker=np.array([0, 0]),
        epoch=np.array([0, 0]),
        batch=np.array([0, 0]),
        pos=np.array([0, 1]),
        draws=np.array([(0.1, 0.2, 0.3), (0.4, 0.5, 0.6)]),
        per_rank=[RankEpoch(0, 0, 2, 1, None, None)],
    )
    rec = build_records([result], Settings(1, 1, 1, 2), shard_fn=lambda key: key[0])
    assert rec.label(int(rec.ids[0])) == "b/2"
    assert rec.shards is not None and rec.shards.tolist() == [1, 0]  # shards b, a
    assert rec.expected is None and len(rec) == 2


# ---- real audits ---------------------------------------------------------------------

ATTEMPTS: dict[str, Any] = {
    "naive": functools.partial(talk.naive, size=100),
    "shard_by_worker": functools.partial(talk.shard_by_worker, size=150),
    "shard_then_shuffle": functools.partial(talk.shard_then_shuffle, size=200),
    "shuffle_then_shard": functools.partial(talk.shuffle_then_shard, size=202),
    "fixed_seed": functools.partial(talk.fixed_seed, size=200),
    "evenly": functools.partial(talk.evenly_dataset, size=200),
    "distributed_sampler": functools.partial(talk.distributed_sampler, size=200),
}


@pytest.fixture(scope="module")
def talk_audits() -> dict[str, AuditResult]:
    results = audit_many(
        list(ATTEMPTS.values()),
        num_workers=2,
        world_size=2,
        epochs=2,
        batch_size=10,
        shard_fn=talk.folder_of,
    )
    return dict(zip(ATTEMPTS, results, strict=True))


def test_naive_generator_every_sample_once_per_worker_and_rank(
    talk_audits: dict[str, AuditResult],
) -> None:
    result = talk_audits["naive"]
    dup = result.finding("duplicates")
    # 2 ranks x 2 workers each yield all 100 samples: 4x, 300 extra deliveries per epoch.
    assert (dup.status, dup.value) == ("FAIL", 300)
    assert dup.detail == "epochs 0-1: 300 extra deliveries, every sample delivered 4x"
    assert result.finding("length").detail == "ranks 0-1 epochs 0-1: len() 100, yielded 200"
    assert result.finding("shuffle").status == "WARN"
    assert not result.ok


def test_shard_by_worker_ignores_ranks_and_leaves_ragged_tails(
    talk_audits: dict[str, AuditResult],
) -> None:
    result = talk_audits["shard_by_worker"]
    assert result.finding("duplicates").detail == (
        "epochs 0-1: 150 extra deliveries, every sample delivered 2x"
    )
    partial = result.finding("partial_batches")
    # 75 samples per worker: 7 full batches and one of 5, in each of 2 workers.
    assert (partial.status, partial.value) == ("WARN", 2)
    assert "partial batches per rank [2, 2]" in partial.detail
    # torch's len(loader) = ceil(150 / 10) = 15, but the workers' tails make 16 batches.
    assert "len(loader) 15, yielded 16 batches" in result.finding("length").detail


def test_shard_then_shuffle_is_exactly_once_but_batches_stay_in_one_folder(
    talk_audits: dict[str, AuditResult],
) -> None:
    result = talk_audits["shard_then_shuffle"]
    assert result.finding("duplicates").status == "PASS"
    assert result.finding("missing").status == "PASS"
    near = result.finding("adjacency")
    # Every in-batch neighbour shares a folder; uniform: 4 * 50 * 49 / (200 * 199).
    assert near.status == "WARN"
    assert near.value == pytest.approx(200 * 199 / (4 * 50 * 49), rel=1e-3)
    assert "100% of in-batch neighbours share a shard" in near.detail


def test_shuffle_then_shard_with_worker_seeds_overlaps_and_unbalances(
    talk_audits: dict[str, AuditResult],
) -> None:
    result = talk_audits["shuffle_then_shard"]
    assert result.finding("duplicates").status == "FAIL"
    assert result.finding("duplicates").value > 0
    assert result.finding("missing").status == "FAIL"
    balance = result.finding("rank_balance")
    # Strided shards of 202: 51 + 51 samples on rank 0 (6 + 6 batches), 50 + 50 on rank 1.
    assert (balance.status, balance.value) == ("FAIL", 2)
    assert "batches per rank [12, 10] (DDP hang risk)" in balance.detail


def test_fixed_seed_repeats_epochs_and_shares_random_streams(
    talk_audits: dict[str, AuditResult],
) -> None:
    result = talk_audits["fixed_seed"]
    assert result.finding("duplicates").status == "PASS"
    assert result.finding("missing").status == "PASS"
    repeat = result.finding("repeated_order")
    assert (repeat.status, repeat.value) == ("FAIL", 2)
    assert "same shuffled order as the previous epoch" in repeat.detail
    rng = result.finding("rng_streams")
    # 8 streams (2 ranks x 2 workers x 2 epochs), all equal: C(8, 2) = 28 pairs, of which
    # 4 differ only in worker and 8 only in rank (same epoch).
    assert (rng.status, rng.value) == ("FAIL", 12 + 16)
    assert "4 pairs of streams equal across workers (random/numpy/torch)" in rng.detail
    assert "8 pairs of streams equal across ranks" in rng.detail


@pytest.mark.parametrize("name", ["evenly", "distributed_sampler"])
def test_correct_datasets_pass_everything(talk_audits: dict[str, AuditResult], name: str) -> None:
    result = talk_audits[name]
    assert result.ok
    assert {f.name: f.status for f in result.findings} == {f.name: "PASS" for f in result.findings}
    assert [(r.rank, r.epoch, r.samples, r.batches) for r in result.records.per_rank] == [
        (0, 0, 100, 10),
        (0, 1, 100, 10),
        (1, 0, 100, 10),
        (1, 1, 100, 10),
    ]
    assert result.records.expected == 200
    # Every worker of every rank delivered, and the draws came from 8 distinct streams.
    assert (
        len(
            {
                (int(r), int(w))
                for r, w in zip(result.records.rank, result.records.worker, strict=True)
            }
        )
        == 4
    )


def test_json_round_trip(talk_audits: dict[str, AuditResult]) -> None:
    import json

    payload = json.loads(talk_audits["naive"].to_json())
    assert payload["ok"] is False
    assert payload["factory"] == "examples.talk_attempts:naive(size=100)"
    assert {f["name"]: f["status"] for f in payload["findings"]}["duplicates"] == "FAIL"
    assert len(payload["per_rank"]) == 4


def broken_factory() -> Any:
    raise RuntimeError("the factory is broken on purpose")


def test_a_failing_factory_reports_the_rank_and_the_cause() -> None:
    with pytest.raises(AuditError, match=r"rank 0 failed while auditing .*broken_factory"):
        run(broken_factory, num_workers=0, world_size=1, epochs=1, batch_size=2)


def test_an_unpicklable_factory_is_explained() -> None:
    with pytest.raises(AuditError, match="must be module-level functions"):
        run(lambda: [1, 2], num_workers=0, world_size=1, epochs=1)


def test_bad_arguments_fail_before_any_process_starts() -> None:
    with pytest.raises(ValueError, match="world_size must be an integer >= 1"):
        run(talk.naive, world_size=0)
    with pytest.raises(AuditError, match="cannot import module 'nowhere'"):
        run("nowhere:factory")


def test_hf_datasets_and_webdataset_pipelines() -> None:
    pytest.importorskip("datasets")
    pytest.importorskip("webdataset")
    hf, wds = audit_many(
        [talk.hf_iterable, talk.webdataset_pipeline],
        num_workers=2,
        world_size=2,
        epochs=2,
        batch_size=10,
        shard_fn=talk.folder_of,
    )
    for result in (hf, wds):
        assert result.ok, result.to_json()
        assert result.finding("duplicates").status == "PASS"
        assert (
            result.finding("rank_balance").detail == "every rank: 100 samples, 10 batches per epoch"
        )
        # Neither gives a len(): the audit says so rather than guessing.
        assert result.finding("length").status == "WARN"
    assert wds.records.labels is not None  # ids are the string __key__s


# --- Stopping: a stuck or failing audit ends every process it started ---

STUCK_DIR = "EVENLY_TEST_STUCK_DIR"


class Stuck(torch.utils.data.IterableDataset[int]):
    """Each worker records ``worker-<rank>-<pid>`` in ``folder``, then blocks in ``__iter__``
    (for 300 s, far past any test).  With ``fail_when``, the worker instead waits until that
    many rank-1 workers are recorded and raises."""

    def __init__(self, folder: str, fail_when: int | None = None) -> None:
        self.folder, self.fail_when = Path(folder), fail_when

    def __iter__(self) -> Any:
        rank = os.environ.get("RANK", "0")
        (self.folder / f"worker-{rank}-{os.getpid()}").touch()
        if self.fail_when is None:
            time.sleep(300)
        else:
            for _ in range(6000):  # 300 s at most, then fail anyway
                if len(list(self.folder.glob("worker-1-*"))) >= self.fail_when:
                    break
                time.sleep(0.05)
        raise RuntimeError("this worker fails on purpose")
        yield 0  # a generator, as most datasets are


def stuck_from_env() -> Stuck:
    """Factory for the CLI: every worker of every rank blocks."""
    folder = os.environ[STUCK_DIR]
    Path(folder, f"rank-{os.environ['RANK']}-{os.getpid()}").touch()
    return Stuck(folder)


def rank0_fails_once_rank1_is_stuck(folder: str) -> Stuck:
    """Rank 1's two workers block; a worker of rank 0 raises once both are running."""
    Path(folder, f"rank-{os.environ['RANK']}-{os.getpid()}").touch()
    return Stuck(folder, fail_when=2 if os.environ["RANK"] == "0" else None)


def _sigint_as_at_a_terminal() -> None:
    """In the child before it runs Python: SIGINT's default disposition, so that Python
    turns it into ``KeyboardInterrupt`` (it keeps SIGINT ignored if it starts so)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie awaiting its reaper is not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")


def _recorded(folder: Path) -> dict[str, list[int]]:
    pids: dict[str, list[int]] = {"rank": [], "worker": []}
    for f in folder.iterdir():
        kind, _, pid = f.name.split("-")
        pids[kind].append(int(pid))
    return pids


@pytest.fixture
def stuck_dir(tmp_path: Path) -> Any:
    """A folder for the pid files; whatever is still running at the end is killed, so a
    failing test leaks nothing."""
    yield tmp_path
    for pids in _recorded(tmp_path).values():
        for pid in pids:
            if _running(pid):
                os.kill(pid, signal.SIGKILL)


needs_proc = pytest.mark.skipif(
    not Path("/proc/self/stat").exists(), reason="reads process states from /proc"
)


@pytest.mark.slow
@needs_proc
def test_timeout_stops_the_ranks_and_their_blocked_workers(
    stuck_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from evenly.audit._cli import main

    monkeypatch.setenv(STUCK_DIR, str(stuck_dir))
    code = main(
        [
            "tests.test_audit:stuck_from_env",
            "--workers",
            "2",
            "--world-size",
            "1",
            "--epochs",
            "1",
            "--timeout",
            "10",
        ]
    )
    assert code == 2
    pids = _recorded(stuck_dir)
    # The premise: the rank had started its 2 workers, blocked in __iter__, before 10 s
    # (it takes 1-3 s; a machine too loaded for that fails here, not silently).
    assert len(pids["rank"]) == 1 and len(pids["worker"]) == 2, pids
    assert [pid for kind in pids.values() for pid in kind if _running(pid)] == []
    err = " ".join(capsys.readouterr().err.split())
    assert "did not finish within its timeout of 10 s (--timeout / timeout=)" in err
    assert "rank(s) [0] had not reported" in err
    assert "Every rank process and its DataLoader workers were stopped" in err


@pytest.mark.slow
@needs_proc
def test_a_failing_rank_stops_the_other_ranks_blocked_workers(stuck_dir: Path) -> None:
    factory = functools.partial(rank0_fails_once_rank1_is_stuck, str(stuck_dir))
    with pytest.raises(AuditError, match=r"(?s)rank 0 failed .*this worker fails on purpose"):
        run(factory, num_workers=2, world_size=2, epochs=1, batch_size=2, timeout=300)
    pids = _recorded(stuck_dir)
    assert len(pids["rank"]) == 2 and len(pids["worker"]) == 4, pids
    assert [pid for kind in pids.values() for pid in kind if _running(pid)] == []


@pytest.mark.slow
@needs_proc
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupted_audit_stops_the_ranks_and_their_workers(
    stuck_dir: Path, signum: int
) -> None:
    """Ctrl-C or a scheduler's SIGTERM, sent to the audit process only (the ranks run in
    their own sessions), still ends every process it started."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, PYTHONPATH=path, **{STUCK_DIR: str(stuck_dir)})
    # No pipes: a process left behind holding one would only turn into a hang here.
    # SIGINT as at a terminal: a suite started in the background by a non-interactive
    # shell (`.ci/run &`) hands its children SIGINT ignored, and Python keeps it so.
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "evenly.audit",
            "tests.test_audit:stuck_from_env",
            "--workers",
            "2",
            "--world-size",
            "2",
            "--epochs",
            "1",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=_sigint_as_at_a_terminal,
    )
    try:
        for _ in range(2400):  # until the 2 ranks' 4 workers are blocked (120 s at most)
            if len(_recorded(stuck_dir)["worker"]) == 4 or proc.poll() is not None:
                break
            time.sleep(0.05)
        assert len(_recorded(stuck_dir)["worker"]) == 4, proc.poll()
        proc.send_signal(signum)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0
    pids = _recorded(stuck_dir)
    assert len(pids["rank"]) == 2, pids
    assert [pid for kind in pids.values() for pid in kind if _running(pid)] == []
