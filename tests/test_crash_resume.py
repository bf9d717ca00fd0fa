"""Crash test: SIGKILL a 2-rank DDP training run mid-epoch, restart it from its last
checkpoint with another num_workers, and check from the per-step logs that each sample
of the epoch was trained on exactly once counting from the checkpoint."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path

import torch

from tests.distributed import ROOT, torchrun

SCRIPT = ROOT / "tests" / "scripts" / "crash_train.py"
N, BATCH, WORLD, EVERY = 640, 8, 2, 5


def launch(tmp: Path, run: str, workers: int, sleep: float) -> subprocess.Popen[bytes]:
    return torchrun(
        SCRIPT,
        "--ckpt",
        tmp / "ckpt.pt",
        "--log-dir",
        tmp,
        "--tag",
        run,
        "--workers",
        workers,
        "--every",
        EVERY,
        "--samples",
        N,
        "--batch-size",
        BATCH,
        "--sleep",
        sleep,
        nproc=WORLD,
    )


def read_logs(tmp: Path) -> list[tuple[str, int, int, int, list[int]]]:
    rows = []
    for rank in range(WORLD):
        path = tmp / f"rank{rank}.log"
        for line in path.read_text().splitlines() if path.exists() else []:
            run, epoch, step, *ids = line.split()
            rows.append((run, rank, int(epoch), int(step), [int(i) for i in ids]))
    return rows


def test_sigkill_mid_epoch_then_resume_with_other_workers(tmp_path: Path) -> None:
    first = launch(tmp_path, "first", workers=2, sleep=0.15)
    deadline = time.monotonic() + 180
    # wait until both ranks are past the second checkpoint, well inside the epoch
    while time.monotonic() < deadline and first.poll() is None:
        steps = [r[3] for r in read_logs(tmp_path) if r[1] == 1]
        if steps and max(steps) >= 2 * EVERY + 2:
            break
        time.sleep(0.05)
    assert first.poll() is None, "the first run ended before it could be killed"
    # torchrun runs the ranks in sessions of their own: kill them and the launcher
    for rank in range(WORLD):
        os.kill(int((tmp_path / f"rank{rank}.pid").read_text()), signal.SIGKILL)
    os.killpg(first.pid, signal.SIGKILL)
    first.communicate(timeout=30)
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=False)
    saved_step = ckpt["step"]
    steps_per_epoch = N // (WORLD * BATCH)
    assert EVERY * 2 <= saved_step < steps_per_epoch
    assert ckpt["loader"]["position"] == saved_step * WORLD * BATCH

    second = launch(tmp_path, "second", workers=1, sleep=0.0)
    out, _ = second.communicate(timeout=180)
    assert second.returncode == 0, out.decode()

    rows = read_logs(tmp_path)
    before = [r for r in rows if r[0] == "first" and r[3] < saved_step]
    redone = [r for r in rows if r[0] == "first" and r[3] >= saved_step]
    after = [r for r in rows if r[0] == "second"]
    assert redone, "the kill came after the checkpoint, so some steps must be redone"
    assert min(r[3] for r in after) == saved_step
    assert max(r[3] for r in after) == steps_per_epoch - 1
    assert {r[2] for r in before + after} == {0}
    trained = Counter(i for r in before + after for i in r[4])
    assert trained == Counter(range(N))  # each sample of the epoch exactly once
    # the redone steps are the very same batches as the killed run's
    redo = {(r[1], r[3]): r[4] for r in redone}
    assert all(redo[(r[1], r[3])] == r[4] for r in after if (r[1], r[3]) in redo)
