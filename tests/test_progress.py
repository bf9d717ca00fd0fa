"""Progress bars: on ``evenly write`` and on scans of many shards, shown on a terminal
only (never in test output), or when asked for."""

from __future__ import annotations

from pathlib import Path

import pytest

import evenly.sources as es
from evenly.sources import _manifest
from evenly.sources._progress import wanted


@pytest.fixture(autouse=True)
def no_forcing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("EVENLY_PROGRESS", raising=False)
    monkeypatch.setenv("EVENLY_CACHE_DIR", str(tmp_path / "cache"))


def test_a_bar_is_shown_on_a_terminal_on_rank_zero_or_when_asked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class Terminal:
        def isatty(self) -> bool:
            return True

    assert not wanted(None)  # pytest's stderr is no terminal
    assert wanted(True) and not wanted(False)
    monkeypatch.setattr("sys.stderr", Terminal())
    assert wanted(None)
    monkeypatch.setenv("RANK", "1")
    assert not wanted(None)  # one bar per job, not one per rank
    monkeypatch.setenv("EVENLY_PROGRESS", "1")
    assert wanted(None)
    monkeypatch.setenv("EVENLY_PROGRESS", "0")
    assert not wanted(None) and wanted(True)


def test_write_shows_its_bar_only_when_asked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = [{"id": i} for i in range(20)]
    es.write(rows, tmp_path / "quiet", format="jsonl", rows_per_shard=5)
    assert capsys.readouterr().err == ""
    es.write(rows, tmp_path / "shown", format="jsonl", rows_per_shard=5, progress=True)
    err = capsys.readouterr().err
    assert "evenly.write jsonl" in err and "20/20" in err


def test_a_scan_of_many_shards_shows_a_bar_when_asked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    n = _manifest.SCAN_BAR_MIN
    for i in range(n):
        (tmp_path / f"s{i:03d}.jsonl").write_text('{"id": 1}\n{"id": 2}\n')
    shards = sorted(str(p) for p in tmp_path.glob("*.jsonl"))
    assert len(es.from_jsonl(shards[: n - 1])) == 2 * (n - 1)
    assert capsys.readouterr().err == ""  # not a terminal
    monkeypatch.setenv("EVENLY_PROGRESS", "1")
    assert len(es.from_jsonl(shards[: n - 1], use_manifest=False)) == 2 * (n - 1)
    assert capsys.readouterr().err == ""  # fewer than SCAN_BAR_MIN shards
    assert len(es.from_jsonl(shards, use_manifest=False)) == 2 * n
    err = capsys.readouterr().err
    assert "scanning shards" in err and f"0/{n}" in err
