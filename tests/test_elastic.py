"""Elastic torchrun, end to end: two torchrun agents (nodes) on 127.0.0.1 with the c10d
rendezvous and ``--nnodes 1:2``, 2 ranks x 2 DataLoader workers each, DDP training that
saves ``loader.state_dict()`` with the model every 2 steps (tests/scripts/
elastic_train.py, docs/elastic.md's recipe).

Mid-epoch one node is killed (its agent and its ranks, SIGKILL): torchrun restarts the
survivors with world size 2, they resume from the last checkpoint. Later the node comes
back: torchrun restarts everyone with world size 4, again from the last checkpoint, and
the job finishes. Counting only the steps each checkpoint kept (a step trained after
the checkpoint that the next start loaded was lost with the node and is trained again),
every sample is trained exactly once per epoch, with equal batch counts on every rank of
every start. A packed loader and a Mix (whose weights change at the first start's step 1),
stepped beside the first loader and checkpointed with it, keep every token once per
packed epoch and each Mix epoch's exact counts and streams through the same changes."""

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

import pytest

from tests.distributed import ROOT, free_port
from tests.scripts import elastic_train

pytestmark = pytest.mark.slow

SCRIPT = ROOT / "tests" / "scripts" / "elastic_train.py"
N, BATCH, EPOCHS = 96, 4, 2  # 6 steps of 16 at world size 4, 12 of 8 at world size 2
TIMEOUT = 420.0


def agent(out: Path, port: int, *, host: bool, name: str) -> subprocess.Popen[bytes]:
    """One node: a torchrun agent with 2 ranks, joining the c10d rendezvous at ``port``."""
    conf = (
        f"is_host={int(host)},join_timeout=300,last_call_timeout=1,close_timeout=30,"
        "keep_alive_interval=1,keep_alive_max_attempt=5"
    )
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1:2",
        "--nproc-per-node",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        "evenly-elastic",
        "--rdzv-conf",
        conf,
        "--max-restarts",
        "3",
        "--monitor-interval",
        "0.5",
        str(SCRIPT),
        "--out",
        str(out),
        "--samples",
        str(N),
        "--batch-size",
        str(BATCH),
        "--epochs",
        str(EPOCHS),
        "--pause",
        "4:3",  # at world size 4: a checkpoint at step 2, step 3 lost with the node
        "--pause",
        "2:5",  # at world size 2: a checkpoint at step 4, step 5 lost at the rejoin
    ]
    env = {
        **os.environ,
        "PYTHONWARNINGS": "ignore",
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)]),
        # torch's shared rendezvous store deadlocks a node that joins a running job
        # (pytorch/pytorch#135712): docs/elastic.md says to set this on every node
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
    }
    with (out / f"{name}.out").open("wb") as log:  # the agent keeps its own descriptor
        return subprocess.Popen(
            cmd, cwd=ROOT, env=env, start_new_session=True, stdout=log, stderr=subprocess.STDOUT
        )


def kill_node(out: Path, node: subprocess.Popen[bytes]) -> None:
    """SIGKILL a node's agent and the ranks it started (each rank records its agent)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(node.pid, signal.SIGKILL)
    node.wait(timeout=30)
    for pid_file in out.glob("pid-*"):
        if int(pid_file.read_text()) == node.pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid_file.name.split("-")[1]), signal.SIGKILL)


def wait_for(path: Path, nodes: list[subprocess.Popen[bytes]], deadline: float) -> None:
    while not path.exists():
        for node in nodes:
            if node.poll() is not None:
                raise AssertionError(f"a node exited with {node.returncode} before {path.name}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {path.name} within {TIMEOUT} s")
        time.sleep(0.2)


def attempts_of(out: Path) -> dict[str, dict[str, Any]]:
    """Every start of the worker group: its world size, the checkpoint it loaded, the
    steps each rank trained, and which ranks finished."""
    attempts: dict[str, dict[str, Any]] = {}
    for path in sorted(out.glob("log-*-rank*.jsonl")):
        lines = [json.loads(line) for line in path.read_text().splitlines()]
        head = lines[0]
        token = path.name.split("-")[1]
        entry = attempts.setdefault(
            token, {"world": head["world"], "start": head["start"], "ranks": {}, "done": set()}
        )
        entry["ranks"][head["rank"]] = [line for line in lines[1:] if "step" in line]
        if lines[-1].get("done"):
            entry["done"].add(head["rank"])
    return attempts


@pytest.fixture(scope="module")
def elastic_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    out = tmp_path_factory.mktemp("elastic")
    port = free_port()
    deadline = time.monotonic() + TIMEOUT
    first = agent(out, port, host=True, name="node-a")
    nodes = [first, agent(out, port, host=False, name="node-b")]
    try:
        wait_for(out / "paused-4", nodes, deadline)
        kill_node(out, nodes.pop())  # the node leaves mid-epoch
        wait_for(out / "paused-2", nodes, deadline)
        nodes.append(agent(out, port, host=False, name="node-b-again"))  # and comes back
        for node in nodes:
            node.wait(timeout=max(1.0, deadline - time.monotonic()))
        logs = "\n".join(p.read_text(errors="replace")[-3000:] for p in out.glob("node-*.out"))
        assert [node.returncode for node in nodes] == [0, 0], logs
    finally:
        for node in nodes:
            if node.poll() is None:
                kill_node(out, node)
    return attempts_of(out)


def kept_chain(attempts: dict[str, dict[str, Any]]) -> list[tuple[str, int | None]]:
    """From the start that finished back to the first: each with the last step of it
    that the next start's checkpoint kept (None: all of it)."""
    finished = [t for t, a in attempts.items() if len(a["done"]) == a["world"]]
    assert len(finished) == 1, attempts
    chain: list[tuple[str, int | None]] = []
    token: str | None = finished[0]
    limit: int | None = None
    while token is not None:
        chain.append((token, limit))
        start = attempts[token]["start"]
        token, limit = start["attempt"], start["step"]
    return chain[::-1]


def test_the_world_shrinks_to_two_and_grows_back_to_four(
    elastic_run: dict[str, dict[str, Any]],
) -> None:
    chain = kept_chain(elastic_run)
    assert [elastic_run[t]["world"] for t, _ in chain] == [4, 2, 4]
    assert [limit for _, limit in chain] == [2, 4, None]
    for token, _ in chain:
        entry = elastic_run[token]
        assert sorted(entry["ranks"]) == list(range(entry["world"]))


def test_every_sample_is_trained_exactly_once_per_epoch_over_the_kept_steps(
    elastic_run: dict[str, dict[str, Any]],
) -> None:
    trained = {epoch: Counter[int]() for epoch in range(EPOCHS)}
    lost = 0
    for token, limit in kept_chain(elastic_run):
        for steps in elastic_run[token]["ranks"].values():
            for step in steps:
                if limit is None or step["step"] <= limit:
                    trained[step["epoch"]].update(step["ids"])
                else:
                    lost += 1
    for epoch in range(EPOCHS):
        assert trained[epoch] == Counter(range(N)), epoch
    assert lost == 4 * 1 + 2 * 1  # one step per rank after each checkpoint was lost


def test_every_rank_of_every_start_trains_the_same_number_of_steps(
    elastic_run: dict[str, dict[str, Any]],
) -> None:
    for token, _ in kept_chain(elastic_run):
        counts = {len(steps) for steps in elastic_run[token]["ranks"].values()}
        assert len(counts) == 1, (token, counts)


def kept_steps(attempts: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Every step record that the checkpoints kept, over all ranks of all starts."""
    kept = []
    for token, limit in kept_chain(attempts):
        for steps in attempts[token]["ranks"].values():
            kept += [s for s in steps if limit is None or s["step"] <= limit]
    return kept


def test_packed_rows_hold_every_token_exactly_once_per_epoch_across_the_changes(
    elastic_run: dict[str, dict[str, Any]],
) -> None:
    """The packed loader, stepped beside the first one and checkpointed with it: every
    token of every document once per packed epoch over the kept steps, through the
    shrink to world size 2 and the growth back to 4."""
    every = Counter(t for doc in elastic_train.documents() for t in doc["input_ids"])
    by_epoch: dict[int, Counter[int]] = {}
    for step in kept_steps(elastic_run):
        by_epoch.setdefault(step["tokens_epoch"], Counter()).update(step["tokens"])
    last = max(by_epoch)
    for epoch in range(last):
        assert by_epoch[epoch] == every, epoch
    assert max(by_epoch[last].values()) == 1 and set(by_epoch[last]) <= set(every)
    assert last >= 2, sorted(by_epoch)  # the run crossed packed epochs, changes included


def test_a_mix_keeps_its_shares_and_streams_across_the_changes_and_a_weight_change(
    elastic_run: dict[str, dict[str, Any]],
) -> None:
    """The Mix (32 samples per epoch of sources a: 64 and b: 32, weights 1:1, then 3:1
    from global position 8 of epoch 0: step 1 of 4 ranks x 2) resumed onto 2 ranks and
    back onto 4: each epoch has exactly the counts its weights give (epoch 0: within 1
    of 4 of a in [0, 8), then 18 of the 24 left; later epochs 24 and 8), and each source's
    stream goes on (no sample twice before every sample once)."""
    a_range = range(1000, 1000 + elastic_train.MIX_A)
    epochs: dict[int, Counter[str]] = {}
    seen = {"a": Counter[int](), "b": Counter[int]()}
    for step in kept_steps(elastic_run):
        for x in step["mixed"]:
            name = "a" if x in a_range else "b"
            epochs.setdefault(step["mixed_epoch"], Counter())[name] += 1
            seen[name][x] += 1
    last = max(epochs)
    assert 4 - 1 + 18 <= epochs[0]["a"] <= 4 + 1 + 18 and sum(epochs[0].values()) == 32
    for epoch in range(1, last):
        assert epochs[epoch] == Counter(a=24, b=8), epoch
    sizes = {"a": elastic_train.MIX_A, "b": elastic_train.MIX_B}
    for name, counts in seen.items():
        per_sample = [counts.get(x, 0) for x in (a_range if name == "a" else range(2000, 2032))]
        assert len(per_sample) == sizes[name]
        assert max(per_sample) - min(per_sample) <= 1, name
    assert last >= 2, sorted(epochs)  # the run crossed Mix epochs, changes included
