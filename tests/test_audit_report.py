"""``evenly audit --report``: the HTML page and its PNG plots, and the CLI's exit codes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest

from evenly.audit import AuditError, AuditResult, all_findings
from evenly.audit._cli import main
from evenly.audit._collect import Settings
from evenly.audit._report import image_size
from evenly.audit._types import RankEpoch, Records

ROOT = Path(__file__).resolve().parents[1]
PLOTS = ("delivery", "order", "batches")


def _check_page(folder: Path, epochs: int) -> str:
    page = (folder / "index.html").read_text(encoding="utf-8")
    for name in PLOTS:
        png = folder / f"{name}.png"
        assert f'src="{name}.png"' in page
        image = matplotlib.image.imread(png)
        width, height = image_size(name, epochs)
        assert image.shape[:2] == (height, width), name
        # Non-trivial: many distinct colours, not a blank canvas.
        colours = np.unique(image.reshape(-1, image.shape[-1]), axis=0)
        assert len(colours) > 20, name
    return page


def _synthetic(epochs: int) -> AuditResult:
    rng = np.random.default_rng(0)
    n = 40
    ids = np.concatenate([rng.permutation(n) for _ in range(epochs)])
    epoch = np.repeat(np.arange(epochs), n)
    index = np.tile(np.arange(n), epochs)
    rank = index % 2
    rec = Records(
        ids=ids.astype(np.int64),
        rank=rank.astype(np.int64),
        worker=((index // 2) % 2).astype(np.int64),
        epoch=epoch.astype(np.int64),
        batch=(index // 2 // 4).astype(np.int64),
        pos=((index // 2) % 4).astype(np.int64),
        draws=rng.random((n * epochs, 3)),
        per_rank=[RankEpoch(r, e, 20, 5, 20, 5) for e in range(epochs) for r in range(2)],
        world_size=2,
        num_workers=2,
        epochs=epochs,
        batch_size=4,
        expected=n,
    )
    return AuditResult("synthetic:factory", Settings(2, 2, epochs, 4), rec, all_findings(rec))


def test_write_report_sizes_follow_the_number_of_epochs(tmp_path: Path) -> None:
    result = _synthetic(epochs=3)
    page = result.write_report(tmp_path / "report")
    assert page == tmp_path / "report" / "index.html"
    text = _check_page(tmp_path / "report", epochs=3)
    assert image_size("delivery", 3) == (1100, 700)
    assert "synthetic:factory" in text and "<td>Duplicates</td>" in text


def test_cli_exit_codes_json_and_report(tmp_path: Path) -> None:
    """One real audit of the naive generator (FAIL) and an evenly.Dataset (OK)."""
    report = tmp_path / "report"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "evenly.audit",
            "examples.talk_attempts:naive",
            "examples.talk_attempts:evenly_dataset",
            "--workers",
            "2",
            "--world-size",
            "2",
            "--epochs",
            "2",
            "--batch-size",
            "10",
            "--json",
            "--report",
            str(report),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 1, proc.stderr  # the naive generator FAILs
    naive, good = json.loads(proc.stdout)
    assert naive["ok"] is False and good["ok"] is True
    dup = {f["name"]: f for f in naive["findings"]}["duplicates"]
    assert dup["detail"] == "epochs 0-1: 600 extra deliveries, every sample delivered 4x"
    naive_page = _check_page(report / "0-naive", epochs=2)
    good_page = _check_page(report / "1-evenly_dataset", epochs=2)
    assert "&mdash; FAIL</h1>" in naive_page and "&mdash; OK</h1>" in good_page
    # The delivery plot of the naive generator has 4 rows (each id delivered 4x).
    assert "every sample delivered 4x" in naive_page


def test_cli_names_a_factory_that_does_not_import(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["no_such_module_here:factory", "--world-size", "1"]) == 2
    err = capsys.readouterr().err
    assert "cannot import module 'no_such_module_here'" in err
    assert main(["os.path:no_such_attr"]) == 2
    assert "module 'os.path' has no attribute 'no_such_attr'" in capsys.readouterr().err


def test_register_adds_the_audit_subcommand() -> None:
    import argparse

    from evenly.audit._cli import register, run

    parser = argparse.ArgumentParser(prog="evenly")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(
        ["audit", "a.b:c", "--workers", "4", "--world-size", "2", "--report", "out", "--json"]
    )
    assert (args.command, args.factories, args.workers, args.world_size) == (
        "audit",
        ["a.b:c"],
        4,
        2,
    )
    assert (args.epochs, args.batch_size, args.report, args.json) == (2, 10, "out", True)
    assert args.func is run


def test_without_matplotlib_the_report_names_the_extra_and_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` fails
    result = _synthetic(epochs=1)
    with pytest.raises(AuditError, match=re.escape("pip install 'evenly[report]'")):
        result.write_report(tmp_path / "report")
    assert not (tmp_path / "report").exists()
    # The CLI says so before it audits anything: not even the factory is imported.
    code = main(["no_such_module_here:factory", "--report", str(tmp_path / "cli")])
    assert code == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "matplotlib, which is not installed" in err
    assert "pip install 'evenly[report]'" in err
    assert "no_such_module_here" not in err
    assert not (tmp_path / "cli").exists()
