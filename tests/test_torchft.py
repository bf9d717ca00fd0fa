"""Fault tolerance without restarts (torchft): three replica groups (one process each,
tests/scripts/torchft_train.py) train DDP across groups through torchft's Manager, with
the lighthouse on 127.0.0.1 and gloo on CPU, over a Parquet dataset read by
``evenly.interop.torchft.FaultTolerantLoader``.

Mid-epoch one group is killed (SIGKILL, in a step, before its all-reduce): the two others
keep stepping (the step it died in is not committed, and its global batch is dealt again
to the two). Later it is started
again: it heals from a peer (model and the loader's committed position, through the
Manager's state-dict hooks) and takes its share from the next step.  Over two epochs
every sample is in exactly one committed step.

The rest runs real torchft Managers in this process (a lighthouse of its own per test):
an uncommitted step, a state saved and loaded by a fresh job, and the loops and Manager
settings that would lose data, refused before the first batch."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import evenly
from evenly.interop.torchft import FaultTolerantLoader
from tests.distributed import ROOT

pytest.importorskip("torchft")

# torchft 0.2.0 logs through the deprecated Logger.warn in its quorum thread
pytestmark = pytest.mark.filterwarnings("ignore:The 'warn' method is deprecated")

SCRIPT = ROOT / "tests" / "scripts" / "torchft_train.py"
N, GLOBAL_BATCH, EPOCHS = 240, 6, 2  # 40 steps an epoch, 2 or 3 samples per group
DIE_AT = 5  # group 2 dies in step 5 of epoch 0, before its all-reduce
TIMEOUT = 240.0


def write_data(root: Path) -> Path:
    data = root / "data"
    data.mkdir()
    for f in range(3):
        ids = list(range(f * N // 3, (f + 1) * N // 3))
        table = pa.table({"id": ids, "x": [float(i % 7) for i in ids]})
        pq.write_table(table, data / f"part-{f}.parquet", row_group_size=16)
    return data


def group(
    out: Path, data: Path, lighthouse: str, g: int, *, hold: bool = False, die_at: int = -1
) -> subprocess.Popen[bytes]:
    """One replica group: one process, its output in ``out/group-<g>-<n>.out``."""
    cmd = [
        sys.executable,
        str(SCRIPT),
        "--out",
        str(out),
        "--data",
        str(data),
        "--lighthouse",
        lighthouse,
        "--group",
        str(g),
        "--global-batch-size",
        str(GLOBAL_BATCH),
        "--epochs",
        str(EPOCHS),
        "--delay",
        "0.05",
        "--die-at",
        str(die_at),
        *(["--hold"] if hold else []),
    ]
    paths = (os.environ.get("PYTHONPATH"), str(ROOT))
    env = {
        **os.environ,
        "PYTHONWARNINGS": "ignore",
        "PYTHONPATH": os.pathsep.join(p for p in paths if p),
    }
    name = f"group-{g}-{len(list(out.glob(f'group-{g}-*.out')))}.out"
    with (out / name).open("wb") as log:  # the child keeps its own descriptor
        return subprocess.Popen(
            cmd, cwd=ROOT, env=env, start_new_session=True, stdout=log, stderr=subprocess.STDOUT
        )


def records(path: Path) -> list[dict[str, Any]]:
    lines = path.read_text().splitlines() if path.exists() else []
    out = []
    for line in lines:
        with contextlib.suppress(json.JSONDecodeError):  # a line being written
            out.append(json.loads(line))
    return out


def wait_until(what: str, ready: Any, procs: list[subprocess.Popen[bytes]], end: float) -> None:
    while not ready():
        for proc in procs:
            if proc.poll() is not None and proc.returncode != 0:
                raise AssertionError(f"a group exited with {proc.returncode} before {what}")
        if time.monotonic() > end:
            raise AssertionError(f"no {what} within {TIMEOUT} s")
        time.sleep(0.1)


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from torchft.coordination import LighthouseServer

    out = tmp_path_factory.mktemp("torchft")
    data = write_data(out)
    lighthouse = LighthouseServer(
        bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=1000, heartbeat_timeout_ms=3000
    )
    end = time.monotonic() + TIMEOUT
    address = lighthouse.address()
    procs = [group(out, data, address, g, hold=True) for g in range(2)]
    procs.append(group(out, data, address, 2, die_at=DIE_AT))
    try:
        wait_until("3 groups ready", lambda: len(list(out.glob("ready-*"))) == 3, procs, end)
        (out / "start").touch()
        victim = procs.pop()
        victim_log = out / f"log-2-{victim.pid}.jsonl"
        assert victim.wait(timeout=max(1.0, end - time.monotonic())) == -signal.SIGKILL
        wait_until("the survivors' hold", lambda: len(list(out.glob("held-*"))) == 2, procs, end)
        again = group(out, data, address, 2)
        procs.append(again)
        wait_until("the restart", lambda: (out / f"ready-2-{again.pid}").exists(), procs, end)
        (out / "release").touch()
        for proc in procs:
            proc.wait(timeout=max(1.0, end - time.monotonic()))
        logs = "\n".join(p.read_text(errors="replace")[-4000:] for p in out.glob("group-*.out"))
        assert [proc.returncode for proc in procs] == [0, 0, 0], logs
    finally:
        for proc in procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
        lighthouse.shutdown()
    return {
        "survivor": records(out / f"log-0-{procs[0].pid}.jsonl"),
        "victim": records(victim_log),
        "restarted": records(out / f"log-2-{again.pid}.jsonl"),
        "all": [r for path in sorted(out.glob("log-*.jsonl")) for r in records(path)],
    }


@pytest.mark.slow
def test_every_sample_of_each_epoch_is_in_exactly_one_committed_step(
    job: dict[str, Any],
) -> None:
    # a step counts if the group that never left committed it; its data is the slices
    # of every group that took part in it (a spare batch of a healing group does not)
    committed = {r["step"] for r in job["survivor"] if r.get("committed")}
    trained = {epoch: Counter[int]() for epoch in range(EPOCHS)}
    per_step: dict[int, list[dict[str, Any]]] = {}
    for r in job["all"]:
        if r.get("committed") and r["participating"] and r["step"] in committed:
            trained[r["epoch"]].update(r["ids"])
            per_step.setdefault(r["step"], []).append(r)
    for epoch in range(EPOCHS):
        assert trained[epoch] == Counter(range(N)), epoch
    for step, slices in per_step.items():  # every group of the quorum took its slice
        assert {len(slices)} == {r["groups"] for r in slices}, step
        assert sum(len(r["ids"]) for r in slices) == GLOBAL_BATCH, step


@pytest.mark.slow
def test_the_step_a_group_died_in_is_dealt_again_to_the_survivors(job: dict[str, Any]) -> None:
    steps = [r for r in job["survivor"] if "step" in r]
    failed = [i for i, r in enumerate(steps) if not r["committed"]]
    assert failed, "no step failed when group 2 died"
    first = failed[0]
    assert steps[first]["step"] == DIE_AT and steps[first]["groups"] == 3
    again = steps[first + 1]  # the same global batch, now in 2 slices of 3
    assert again["step"] == DIE_AT and again["groups"] == 2
    dealt = {i for r in job["all"] if r.get("step") == DIE_AT for i in r["ids"]}
    assert len(dealt) == GLOBAL_BATCH, dealt  # the failed slices and the re-dealt ones


@pytest.mark.slow
def test_the_quorum_shrank_and_grew_back_mid_epoch(job: dict[str, Any]) -> None:
    sizes = [r["groups"] for r in job["survivor"] if r.get("committed")]
    shrank = sizes.index(2, sizes.index(3))
    assert 3 in sizes[shrank:], sizes
    assert job["survivor"][shrank]["epoch"] == 0  # the victim died in the first epoch
    # the killed group trained committed steps before it died, the restarted one after
    assert any(r.get("committed") and r["participating"] for r in job["victim"])
    restarted = [r for r in job["restarted"] if "step" in r]
    assert restarted[0]["step"] > 0  # it joined a run in progress ...
    assert any(r["committed"] and r["participating"] for r in restarted)  # ... and trained


@pytest.mark.slow
def test_every_group_ends_with_the_same_state(job: dict[str, Any]) -> None:
    ends = [r["state"] for r in job["all"] if r.get("done")]
    assert len(ends) == 3
    assert all((s["epoch"], s["position"]) == (EPOCHS, 0) for s in ends), ends


# ---- real Managers in this process ------------------------------------------------------
Managers = Callable[..., Any]


@pytest.fixture
def managers() -> Iterator[Managers]:
    """``managers(name, job=0, **settings)``: a torchft Manager of a one-process replica
    group, with its own store, under the lighthouse of job ``job`` (of this test's own)."""
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo
    from torchft.coordination import LighthouseServer

    lighthouses: dict[int, Any] = {}
    made: list[tuple[Any, Any]] = []

    def make(name: str, *, job: int = 0, **settings: Any) -> Any:
        if job not in lighthouses:
            lighthouses[job] = LighthouseServer(
                bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=100
            )
        lighthouse = lighthouses[job]
        store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        user: dict[str, Any] = {}
        manager = Manager(
            pg=ProcessGroupGloo(timeout=timedelta(seconds=20)),
            load_state_dict=user.update,
            state_dict=lambda: dict(user),
            min_replica_size=1,
            rank=0,
            world_size=1,
            store_addr="127.0.0.1",
            store_port=store.port,
            lighthouse_addr=lighthouse.address(),
            replica_id=name,
            hostname="127.0.0.1",
            timeout=timedelta(seconds=20),
            **settings,
        )
        made.append((manager, store))
        return manager

    yield make
    for manager, _ in made:
        manager.shutdown(wait=False)
    for lighthouse in lighthouses.values():
        lighthouse.shutdown()


def dataset(n: int = 20) -> evenly.Dataset[Any]:
    return evenly.Dataset(list(range(n)), shuffle=True, seed=1, rank=0, world_size=1)


def step(manager: Any, batches: Iterator[Any], *, fail: bool = False) -> tuple[list[int], bool]:
    """One training step's data: the quorum, the batch, the commit (failed on request)."""
    manager.start_quorum()
    batch = next(batches)
    if fail:
        manager.report_error(RuntimeError("a failed all-reduce"))
    return batch.tolist(), manager.should_commit()


def test_an_uncommitted_step_deals_the_same_global_batch_again(managers: Managers) -> None:
    manager = managers("a", init_sync=False)
    batches = iter(FaultTolerantLoader(dataset(), manager, global_batch_size=4))
    first, committed = step(manager, batches)
    assert committed
    second, committed = step(manager, batches, fail=True)
    assert not committed
    again, committed = step(manager, batches)
    assert committed and again == second
    third, _ = step(manager, batches)
    whole = [int(i) for b in evenly.DataLoader(dataset(), batch_size=4) for i in b]
    assert first + second + third == whole[:12]  # the epoch's order, each batch once


def test_packed_rows_hold_every_token_once_over_the_committed_steps(managers: Managers) -> None:
    """Packing (its rows do not depend on the world): an uncommitted step's rows are
    dealt again, and the committed steps of the epoch hold every token exactly once."""
    docs = [{"input_ids": [100 * d + j + 1 for j in range(2 + d % 5)]} for d in range(24)]
    packed = evenly.Dataset(
        docs, shuffle=True, seed=3, rank=0, world_size=1, pack=evenly.Packing(6, pad_id=0)
    )
    manager = managers("a", init_sync=False)
    loader = FaultTolerantLoader(packed, manager, global_batch_size=2)
    batches = iter(loader)
    committed: Counter[int] = Counter()
    failed_rows = None
    steps = 0
    while True:
        manager.start_quorum()
        batch = next(batches, None)
        if batch is None:
            break
        rows = batch["input_ids"].tolist()
        if steps == 2:  # this step fails: its rows come again at the next step
            manager.report_error(RuntimeError("a failed all-reduce"))
            failed_rows = rows
        elif failed_rows is not None:
            assert rows == failed_rows
            failed_rows = None
        if manager.should_commit():
            committed.update(t for row in rows for t in row if t != 0)
        steps += 1
    assert committed == Counter(t for doc in docs for t in doc["input_ids"])
    assert loader.epoch == 1 and steps > 3


def test_a_mix_keeps_its_counts_over_the_committed_steps_and_resumes(managers: Managers) -> None:
    """A Mix (32 samples per epoch, weights 3:1) under torchft: a failed step's batch is
    dealt again, each epoch's committed samples hold exactly the counts its weights give
    and each source's stream goes on; a fresh job resumes the saved state mid-epoch."""

    def mixed() -> evenly.Dataset[Any]:
        mix = evenly.Mix(
            {"a": list(range(100, 124)), "b": list(range(200, 216))},
            weights={"a": 3, "b": 1},
            samples_per_epoch=32,
            min_step=2,
        )
        return evenly.Dataset(mix, shuffle=True, seed=4, rank=0, world_size=1)

    def run(loader: Any, stop: int | None = None, fail_at: int | None = None) -> list[list[int]]:
        steps, batches, failed = [], iter(loader), None
        while stop is None or len(steps) < stop:
            loader.manager.start_quorum()
            batch = next(batches, None)
            if batch is None:
                break
            ids = [int(i) for i in batch]
            if len(steps) == fail_at and failed is None:
                loader.manager.report_error(RuntimeError("a failed all-reduce"))
                failed = ids
            elif failed is not None and failed is not True:
                assert ids == failed  # the same global batch again
                failed = True
            if loader.manager.should_commit():
                steps.append(ids)
        return steps

    manager = managers("a", init_sync=False)
    loader = FaultTolerantLoader(mixed(), manager, global_batch_size=4)
    first = run(loader, stop=3, fail_at=1)  # 12 of epoch 0's 32 positions
    state = loader.state_dict()
    assert (state["epoch"], state["position"]) == (0, 12)
    fresh = FaultTolerantLoader(mixed(), managers("b", job=1, init_sync=False), global_batch_size=4)
    fresh.load_state_dict(state)
    rest = run(fresh)  # the rest of epoch 0
    epoch0 = [i for step in first + rest for i in step]
    assert len(epoch0) == 32 and sum(i < 200 for i in epoch0) == 24
    assert max(Counter(epoch0).values()) == 1  # 24 of a's 24 and 8 of b's 16: once each
    whole = [int(i) for b in evenly.DataLoader(mixed(), batch_size=4) for i in b]
    assert epoch0 == whole  # the order an evenly.DataLoader deals, step for step
    assert fresh.epoch == 1
    epoch1 = [i for step in run(fresh) for i in step]
    assert sum(i < 200 for i in epoch1) == 24 and len(epoch1) == 32
    b_seen = Counter(i for i in epoch0 + epoch1 if i >= 200)
    assert set(b_seen) == set(range(200, 216)) and max(b_seen.values()) == 1  # b's stream


def test_the_state_is_the_committed_position_and_a_fresh_job_resumes_it(
    managers: Managers,
) -> None:
    manager = managers("a", init_sync=False)
    loader = FaultTolerantLoader(dataset(), manager, global_batch_size=4)
    batches = iter(loader)
    seen = [step(manager, batches)[0] for _ in range(2)]
    manager.start_quorum()
    next(batches)  # dealt, not committed: not in the state
    state = loader.state_dict()
    assert (state["epoch"], state["position"]) == (0, 8)
    # a restart of everything: another Manager, the saved state, one group of four
    other = managers("b", job=1, init_sync=False)
    fresh = FaultTolerantLoader(dataset(), other, global_batch_size=4)
    fresh.load_state_dict(state)
    rest = []
    batches = iter(fresh)
    while True:
        fresh.manager.start_quorum()
        batch = next(batches, None)
        if batch is None:
            break
        rest.append(batch.tolist())
        assert fresh.manager.should_commit()
    whole = [int(i) for b in evenly.DataLoader(dataset(), batch_size=4) for i in b]
    assert [i for b in seen + rest for i in b] == whole
    assert fresh.epoch == 1 and fresh.state_dict()["position"] == 0
    plain = evenly.DataLoader(dataset(), batch_size=2)  # evenly's own loader takes it too
    plain.load_state_dict(state)
    assert [i for b in plain for i in b.tolist()] == whole[8:]


def test_a_batch_taken_before_the_steps_quorum_is_refused(managers: Managers) -> None:
    manager = managers("a", init_sync=False)
    loader = FaultTolerantLoader(dataset(), manager, global_batch_size=4)
    with pytest.raises(RuntimeError, match=r"zero_grad\(\)"):
        next(iter(loader))  # `for batch in loader:` takes the first batch before zero_grad()
    batches = iter(loader)
    step(manager, batches)
    with pytest.raises(RuntimeError, match="after the step's quorum started"):
        next(batches)  # the second step's batch, under the first step's quorum
    # the check reads torchft's private Manager._quorum_future: each quorum a new future
    futures = [manager._quorum_future]
    manager.start_quorum()
    futures.append(manager._quorum_future)
    assert futures[1] is not None and futures[1] is not futures[0]


def test_torchfts_default_step_zero_healing_is_refused_before_the_first_batch(
    managers: Managers,
) -> None:
    # use_async_quorum=True, init_sync=True (torchft's defaults): at step 0 every group but
    # one heals and its gradients are zeroed, yet it is counted in the step
    first, second = managers("g0"), managers("g1")
    loaders = [FaultTolerantLoader(dataset(), m, global_batch_size=4) for m in (first, second)]
    first.start_quorum()
    second.start_quorum()
    outcomes = []
    for loader in loaders:
        try:
            outcomes.append(next(iter(loader)).tolist())
        except RuntimeError as e:
            outcomes.append(str(e))
    refused = [o for o in outcomes if isinstance(o, str)]
    assert len(refused) == 1 and "init_sync=False" in refused[0], outcomes


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: evenly.Dataset(list(range(8)), pad="none"), "pad='none'"),
    ],
)
def test_what_cannot_be_dealt_per_step_is_refused(
    managers: Managers, build: Callable[[], Any], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        FaultTolerantLoader(build(), managers("a", init_sync=False), global_batch_size=4)


def test_a_second_loader_on_one_manager_is_refused(managers: Managers) -> None:
    manager = managers("a", init_sync=False)
    FaultTolerantLoader(dataset(), manager, global_batch_size=4)
    with pytest.raises(ValueError, match="one loader per Manager"):
        FaultTolerantLoader(dataset(), manager, global_batch_size=4)


def test_a_group_that_joins_under_a_blocking_quorum_takes_part_in_the_step_it_heals_in(
    managers: Managers,
) -> None:
    # use_async_quorum=False: a joining group heals in start_quorum() (model and the
    # loader's committed position from a peer) and takes its slice of that very step; 3
    # groups do not divide global_batch_size=4: their steps take 3 samples
    n = 24
    records: dict[str, list[tuple[int, bool, bool, int, list[int]]]] = {g: [] for g in "abc"}
    errors: list[BaseException] = []
    made = {g: managers(g, use_async_quorum=False) for g in "abc"}  # (on this thread)

    def train(g: str) -> None:
        try:
            marked = evenly.Dataset(
                list(range(n)),
                shuffle=True,
                seed=2,
                rank=0,
                world_size=1,
                pad="mask",
                transform=lambda i: -1 if evenly.is_padding() else i,
            )
            manager = made[g]
            loader = FaultTolerantLoader(marked, manager, global_batch_size=4)
            batches = iter(loader)
            while True:
                manager.start_quorum()
                batch = next(batches, None)
                if batch is None:
                    break
                step = manager.current_step()
                manager.allreduce(torch.ones(1)).wait()  # the gradients' all-reduce
                committed = manager.should_commit()
                groups = manager.num_participants()
                records[g].append((step, committed, loader.participating, groups, batch.tolist()))
                time.sleep(0.05)
        except BaseException as e:
            errors.append(e)

    threads = {g: threading.Thread(target=train, args=(g,), daemon=True) for g in "abc"}
    threads["a"].start()
    threads["b"].start()
    end = time.monotonic() + 60
    while len(records["a"]) < 2 and not errors and time.monotonic() < end:
        time.sleep(0.02)
    threads["c"].start()  # joins a run in progress
    for thread in threads.values():
        thread.join(timeout=max(1.0, end - time.monotonic()))
    assert not errors, errors
    trained = Counter(
        i for rs in records.values() for _, committed, _, _, ids in rs if committed for i in ids
    )
    pads = trained.pop(-1, 0)
    assert trained == Counter(range(n))
    assert pads < 3  # the epoch's last step only, as under DDP
    first = records["c"][0]
    assert first[0] > 0 and first[1] and first[2] and first[3] == 3  # healed and took part
    sizes = {r[3]: len(r[4]) for rs in records.values() for r in rs[:-1]}  # not the last
    assert sizes == {2: 2, 3: 1}  # 4 samples a step over 2 groups, 3 over 3
