"""Two simulated nodes over files, with and without a shared ``cache_dir``.

Two torchrun agents with the c10d rendezvous on 127.0.0.1 (``--nnodes 2``, 2 ranks x 2
DataLoader workers each) run tests/scripts/multinode_cache_job.py.  One agent runs under
``unshare -u -m``: another host name (``node-b``) and a private /dev/shm (a tmpfs mounted
in its own mount namespace), so the two nodes share no shared memory and no host name.
Each rank reads a Parquet source with a global shuffle and a packed dataset
(``evenly.Packing`` over pre-tokenized Parquet), once with one ``cache_dir`` both nodes
share and once with a private one per node.  One launch serves every test here.

What is checked: exactly once over the four ranks (samples, and tokens under packing),
equal batch counts, the same batches whatever ``cache_dir`` is shared, and how often the
node-shared files (decoded row groups, packing's lengths and plans) were written: once in
all with the shared ``cache_dir``, once per node with private ones.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.distributed import ROOT, free_port, start_job, wait_for_job

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        sys.platform != "linux" or os.geteuid() != 0 or shutil.which("unshare") is None,
        reason="simulating a second node needs root and unshare (Linux namespaces)",
    ),
]

SCRIPT = ROOT / "tests" / "scripts" / "multinode_cache_job.py"
NODES, PER_NODE = 2, 2
WORLD = NODES * PER_NODE
# 4 files of 23 rows in row groups of 8 (12 row groups): 23 samples per rank, 5 batches
# of 4 and one of 3, no padding
FILES, ROWS, GROUP, BATCH = 4, 23, 8, 4
N = FILES * ROWS
DOCS, SEQ_LEN = 48, 32
TIMEOUT = 300.0


def write_data(root: Path) -> tuple[Path, Path, int]:
    """Parquet samples (``id``) and pre-tokenized Parquet documents (``input_ids``), every
    token id of the corpus distinct (1..T): exactly-once is a Counter over tokens."""
    samples, tokens = root / "samples", root / "tokens"
    samples.mkdir()
    tokens.mkdir()
    for f in range(FILES):
        ids = list(range(f * ROWS, (f + 1) * ROWS))
        table = pa.table({"id": ids, "x": [float(i) for i in ids]})
        pq.write_table(table, samples / f"part-{f}.parquet", row_group_size=GROUP)
    lengths = np.random.default_rng(0).integers(1, 60, DOCS)
    total = int(lengths.sum())
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    docs = [list(range(int(lo) + 1, int(hi) + 1)) for lo, hi in itertools.pairwise(bounds)]
    half = DOCS // 2
    for f, part in enumerate((docs[:half], docs[half:])):
        table = pa.table({"input_ids": pa.array(part, pa.list_(pa.int32()))})
        pq.write_table(table, tokens / f"part-{f}.parquet", row_group_size=8)
    return samples, tokens, total


def agent(args: list[str], port: int, *, other_host: bool) -> subprocess.Popen[bytes]:
    """One node: a torchrun agent with 2 ranks in the c10d rendezvous at ``port``; with
    ``other_host`` in new UTS and mount namespaces (host name node-b, its own /dev/shm)."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        str(NODES),
        "--nproc-per-node",
        str(PER_NODE),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        "evenly-nodes",
        str(SCRIPT),
        *args,
    ]
    if other_host:
        inner = 'hostname node-b && mount -t tmpfs tmpfs /dev/shm && exec "$@"'
        cmd = ["unshare", "-u", "-m", "sh", "-c", inner, "sh", *cmd]
    return start_job(cmd)


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("nodes")
    samples, tokens, total = write_data(root)
    out = root / "out"
    out.mkdir()
    port = free_port()
    agents = []
    for node in range(NODES):
        args = ["--out", out, "--parquet", samples, "--tokens", tokens]
        args += ["--shared", root / "shared", "--private", root / f"private-{node}"]
        agents.append(agent([str(a) for a in args], port, other_host=node == 1))
    wait_for_job(out, agents, TIMEOUT)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]
    writes = (out / "writes.log").read_text().splitlines()
    return {
        "ranks": ranks,
        "writes": [w.split(" ", 3) for w in writes],
        "root": root,
        "tokens": total,
    }


def test_two_nodes_with_their_own_host_names_and_shared_memory(job: dict[str, Any]) -> None:
    ranks = job["ranks"]
    assert [r["rank"] for r in ranks] == list(range(WORLD))
    assert {r["world_size"] for r in ranks} == {WORLD}
    by_node: dict[int, set[tuple[str, int]]] = {}
    for r in ranks:
        by_node.setdefault(r["node"], set()).add((r["host"], r["shm"]))
    assert sorted(by_node) == list(range(NODES))
    # one host name and one /dev/shm per node, different across the nodes
    assert all(len(v) == 1 for v in by_node.values())
    (host0, shm0), (host1, shm1) = (next(iter(by_node[n])) for n in range(NODES))
    assert "node-b" in {host0, host1} and host0 != host1 and shm0 != shm1


@pytest.mark.parametrize("cache", ["shared", "private"])
def test_parquet_global_shuffle_exactly_once_over_the_nodes(
    job: dict[str, Any], cache: str
) -> None:
    runs = [r[f"parquet-{cache}"] for r in job["ranks"]]
    union = Counter(i for run in runs for b in run["batches"] for i in b)
    assert union == Counter(range(N))
    counts = [len(run["batches"]) for run in runs]
    assert counts == [-(-N // (WORLD * BATCH))] * WORLD
    assert {run["num_batches"] for run in runs} == {counts[0]}
    # a global shuffle: every rank reads from every file
    for run in runs:
        assert {i // ROWS for b in run["batches"] for i in b} == set(range(FILES))


@pytest.mark.parametrize("cache", ["shared", "private"])
def test_packed_tokens_exactly_once_over_the_nodes(job: dict[str, Any], cache: str) -> None:
    runs = [r[f"packed-{cache}"] for r in job["ranks"]]
    union = Counter(t for run in runs for row in run["rows"] for t in row)
    assert union == Counter(range(1, job["tokens"] + 1))
    counts = [run["num_batches"] for run in runs]
    assert len(set(counts)) == 1 and counts[0] > 0


def test_sharing_the_cache_dir_changes_no_batch(job: dict[str, Any]) -> None:
    for r in job["ranks"]:
        assert r["parquet-shared"]["batches"] == r["parquet-private"]["batches"]
        assert r["packed-shared"]["rows"] == r["packed-private"]["rows"]


def test_node_shared_files_written_once_with_a_shared_cache_dir_once_per_node_without(
    job: dict[str, Any],
) -> None:
    root: Path = job["root"]
    shared, private = str(root / "shared"), [str(root / f"private-{n}") for n in range(NODES)]
    writes = Counter((kind, where.split(":", 1)[0]) for kind, _, _, where in job["writes"])
    groups = FILES * -(-ROWS // GROUP) + 2 * -(-(DOCS // 2) // 8)  # samples' and tokens'
    assert writes[("rows", shared)] == groups
    assert writes[("lengths", shared)] == 1
    assert writes[("plan", shared)] == 1
    for cache in private:
        assert writes[("rows", cache)] == groups
        assert writes[("lengths", cache)] == 1
        assert writes[("plan", cache)] == 1
    # and every file the nodes trust is complete: no writer's part file is left
    leftovers = [p for p in (root / "shared").rglob("*") if ".part-" in p.name]
    assert leftovers == []
