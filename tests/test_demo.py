"""The README's main job runs: torchrun, 2 real DDP ranks x 2 workers, guarantees hold."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.distributed import free_port

ROOT = Path(__file__).resolve().parents[1]


def test_demo_trains_with_ddp_and_reports_the_guarantees_hold() -> None:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        str(ROOT / "examples" / "ddp_demo.py"),
        "--samples",
        "200",
        "--batch-size",
        "16",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "evenly guarantees on what training received: HOLD" in out
    evenly_table = out.split("== naive")[0]
    assert "duplicates            0                   0" in evenly_table
    assert "batches/rank          [7, 7]              [7, 7]" in evenly_table
    naive_table = out.split("== naive")[1]
    # every sample 2 workers x 2 ranks = 4 times: 3 duplicates of each of 200
    assert "duplicates            600                 600" in naive_table
