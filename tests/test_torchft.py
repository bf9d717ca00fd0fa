"""Fault tolerance without restarts (torchft): three replica groups (one process each,
tests/scripts/torchft_train.py) train DDP across groups through torchft's Manager, with
the lighthouse on 127.0.0.1 and gloo on CPU, over a Parquet dataset read by
``evenly.interop.torchft.FaultTolerantLoader``.

Mid-epoch one group is killed (SIGKILL, in a step, before its all-reduce): the two others
keep stepping (the step it died in is not committed, and its global batch is dealt again
to the two). Later it is started
again: it heals from a peer (model and the loader's committed position, through the
Manager's state-dict hooks) and takes its share from the next step.  Over two epochs
every sample is in exactly one committed step."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.distributed import ROOT

pytest.importorskip("torchft")

pytestmark = pytest.mark.slow

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


def test_every_group_ends_with_the_same_state(job: dict[str, Any]) -> None:
    ends = [r["state"] for r in job["all"] if r.get("done")]
    assert len(ends) == 3
    assert all((s["epoch"], s["position"]) == (EPOCHS, 0) for s in ends), ends
