"""``evenly audit --nodes N``: the ranks as N simulated nodes, as torchrun starts them.

Real rank processes (gloo on 127.0.0.1) and real DataLoader workers.  One CLI audit on
2 nodes x 2 ranks x 2 workers runs an ``evenly.Dataset`` (PASS) next to a dataset that
splits by ``LOCAL_RANK``, the classic multi-node bug (every node reads the same data:
FAIL); the same dataset on 1 node of 4 ranks passes.  What each rank saw (its
``GROUP_RANK``, ``LOCAL_RANK``, host name) comes back in the JSON.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from torch.utils.data import IterableDataset, get_worker_info

from evenly.audit import AuditError, AuditResult, Records, all_findings, audit_many
from evenly.audit._cli import main
from evenly.audit._report import _page
from evenly.audit._table import result_table
from evenly.audit._types import Settings
from evenly.testing import assert_loader_correct

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # the rank processes inherit sys.path

#: Samples of the LOCAL_RANK dataset: 4 ranks x 2 workers x 2 full batches of 10.
SIZE = 160

SPLIT = "tests.test_audit_nodes:local_rank_split"


class LocalRankSplit(IterableDataset[int]):
    """Splits by ``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE`` and the DataLoader worker: exact on
    one node, and every node reads the same samples on several."""

    def __iter__(self) -> Iterator[int]:
        local, per_node = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        yield from range(local * workers + worker, SIZE, per_node * workers)

    def __len__(self) -> int:
        return SIZE // int(os.environ["LOCAL_WORLD_SIZE"])


def local_rank_split() -> LocalRankSplit:
    return LocalRankSplit()


def _uts_allowed() -> bool:
    """Whether this machine lets a process enter a UTS namespace of its own (asked of
    util-linux's ``unshare``, not of the audit)."""
    if shutil.which("unshare") is None:
        return False
    run = subprocess.run(["unshare", "--uts", "true"], capture_output=True, check=False)
    return run.returncode == 0


def test_two_nodes_pass_evenly_and_fail_a_local_rank_split(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    junit = tmp_path / "audit.xml"
    flags = "--nodes 2 --world-size 4 --workers 2 --epochs 2 --batch-size 10 --json --junit"
    code = main(["examples.talk_attempts:evenly_dataset", SPLIT, *flags.split(), str(junit)])
    out = capsys.readouterr()
    assert code == 1, out.err  # the LOCAL_RANK split FAILs
    good, split = json.loads(out.out)
    assert good["ok"] is True, good["findings"]
    assert {f["status"] for f in good["findings"]} == {"PASS"}
    # Every rank saw torchrun's multi-node variables: node = rank // 2, local rank = rank % 2.
    for result in (good, split):
        assert result["nodes"] == 2
        seen = result["ranks_seen"]
        assert [(s["rank"], s["node"], s["local_rank"], s["local_world_size"]) for s in seen] == [
            (0, 0, 0, 2),
            (1, 0, 1, 2),
            (2, 1, 0, 2),
            (3, 1, 1, 2),
        ]
        assert result["node_layout"].startswith(
            "2 nodes x 2 ranks (GROUP_RANK 0-1, LOCAL_RANK 0-1)"
        )
        if _uts_allowed():
            # each node's ranks under their node's own host name
            assert [s["host"] for s in seen] == [f"evenly-node-{r // 2}" for r in range(4)]
            assert {s["host_note"] for s in seen} == {None}
            assert result["node_layout"].endswith("; hosts evenly-node-0, evenly-node-1")
        else:
            assert all(s["host_note"] for s in seen), seen
            assert "one host name for all nodes" in result["node_layout"]
    assert split["ok"] is False
    dup = {f["name"]: f for f in split["findings"]}["duplicates"]
    assert dup["status"] == "FAIL"
    assert dup["detail"] == "epochs 0-1: 160 extra deliveries, every sample delivered 2x"
    suites = ET.parse(junit).getroot().findall("testsuite")
    layouts = [s.find("properties/property[@name='nodes']") for s in suites]
    assert [p.get("value") for p in layouts if p is not None] == [good["node_layout"]] * 2


def test_a_local_rank_split_passes_on_one_node() -> None:
    """The same dataset and ranks on one node (LOCAL_RANK = RANK) is exact: the FAIL
    above comes from the nodes."""
    result = assert_loader_correct(SPLIT, world_size=4, num_workers=2, nodes=1, resume=False)
    assert result.finding("duplicates").status == "PASS"
    assert result.finding("missing").status == "PASS"
    assert [(s["node"], s["local_rank"]) for s in result.records.seen] == [
        (None, r) for r in range(4)
    ]
    assert result.records.layout() == "1 node x 4 rank(s)"
    assert str(result_table(result).title).endswith(
        "local_rank_split: 4 rank(s) x 2 worker(s) x 2 epoch(s), batch size 10"
    )


def test_the_table_and_the_html_report_name_the_node_layout() -> None:
    empty = np.zeros(0, dtype=np.int64)
    seen = [{"rank": r, "node": r // 3, "host": "vm", "host_note": "needs root"} for r in range(6)]
    rec = Records(
        ids=empty,
        rank=empty,
        worker=empty,
        epoch=empty,
        batch=empty,
        pos=empty,
        draws=np.zeros((0, 3)),
        per_rank=[],
        world_size=6,
        num_workers=1,
        epochs=1,
        batch_size=2,
        expected=0,
        nodes=2,
        seen=seen,
    )
    result = AuditResult("demo:f", Settings(1, 6, 1, 2, nodes=2), rec, all_findings(rec))
    table = result_table(result)
    assert (
        str(table.title)
        == "evenly audit demo:f: 2 nodes x 3 ranks x 1 worker(s) x 1 epoch(s), batch size 2"
    )
    assert str(table.caption).endswith(
        "nodes: 2 nodes x 3 ranks (GROUP_RANK 0-1, LOCAL_RANK 0-2); one host name for all "
        "nodes, vm (needs root)"
    )
    page = _page(result.factory, rec, result.findings)
    assert "<p>Nodes: 2 nodes x 3 ranks (GROUP_RANK 0-1, LOCAL_RANK 0-2); one host" in page


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--nodes", "0"], "nodes (--nodes) must be an integer >= 1, got 0"),
        (
            ["--nodes", "3", "--world-size", "4"],
            "world_size 4 (--world-size) is not a multiple of nodes 3 (--nodes): each "
            "simulated node runs world_size / nodes ranks, as torchrun's --nproc-per-node; "
            "use nodes 1, 2 or 4, or a world_size that is a multiple of 3",
        ),
        (
            ["--nodes", "2", "--world-size", "4", "--resume", "--resume-world-size", "3"],
            "resume_world_size 3 (--resume-world-size) is not a multiple of resume_nodes 2 "
            "(--resume-nodes)",
        ),
        (
            ["--world-size", "4", "--resume", "--resume-nodes", "3"],
            "resume_world_size 4 (--resume-world-size) is not a multiple of resume_nodes 3",
        ),
    ],
)
def test_bad_nodes_are_named_before_any_rank_starts(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([SPLIT, *args]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert message in err


def test_bad_nodes_in_python() -> None:
    with pytest.raises(ValueError, match=r"world_size 4 .* not a multiple of nodes 3"):
        assert_loader_correct(SPLIT, world_size=4, nodes=3)
    with pytest.raises(ValueError, match=r"nodes \(--nodes\) must be an integer >= 1"):
        audit_many([SPLIT], world_size=2, nodes=True)
    with pytest.raises(AuditError, match="cannot import module 'nowhere'"):
        audit_many(["nowhere:factory"], world_size=2, nodes=2)


def test_resume_onto_other_nodes() -> None:
    """An evenly.Dataset audited on 2 nodes x 1 rank resumes onto 1 node of 2 ranks: the
    resumed ranks see a one-node group."""
    (result,) = audit_many(
        ["tests.zoo:evenly_dataset"],
        world_size=2,
        num_workers=0,
        epochs=1,
        batch_size=4,
        nodes=2,
        resume=True,
        resume_nodes=1,
    )
    assert result.ok, result.findings
    assert [(s["node"], s["local_rank"]) for s in result.records.seen] == [(0, 0), (1, 0)]
    assert result.resume is not None and result.resume.stops
    for stop in result.resume.stops:
        assert (stop.world_size, stop.nodes, stop.error) == (2, 1, None)
        before, after = stop.segments[0], stop.segments[1]
        assert [r.seen["node"] for r in before] == [0, 1]
        assert [(r.seen["node"], r.seen["local_rank"]) for r in after] == [(None, 0), (None, 1)]
    assert result.to_dict()["resume"]["stops"][0]["nodes"] == 1
    assert result.finding("resume").detail.endswith("resumed onto 2 ranks x 0 workers")
