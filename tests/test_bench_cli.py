"""``evenly bench``: on a deliberately slow dataset (a sleep in the read, in the
workers) the advice is more workers; on a fast one, no workers.  The advice is asserted,
never a time."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

import evenly
from evenly.bench import Facts, Row, advise
from evenly.cli import main


class SlowRead:
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> int:
        time.sleep(0.005)  # I/O-like: each worker waits on its own
        return i


def slow() -> evenly.Dataset[int]:
    return evenly.Dataset(SlowRead(), shuffle=True)


def fast() -> tuple[evenly.Dataset[int], dict[str, object]]:
    return evenly.Dataset(list(range(5000)), shuffle=True), {"persistent_workers": False}


def bench(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, object]:
    assert main(["bench", *args, "--json", "--batches", "8", "--batch-size", "4"]) == 0
    return json.loads(capsys.readouterr().out)  # type: ignore[no-any-return]


def codes(result: dict[str, object]) -> list[str]:
    return [a["code"] for a in result["advice"]]  # type: ignore[attr-defined, index]


def test_a_dataset_that_waits_on_reads_is_advised_more_workers(
    capsys: pytest.CaptureFixture[str],
) -> None:
    result = bench(capsys, "tests.test_bench_cli:slow", "--workers", "2,0")
    assert [r["workers"] for r in result["rows"]] == [0, 2]  # type: ignore[attr-defined]
    assert "more-workers" in codes(result) and "no-workers" not in codes(result)
    read = [r["stages"]["read"] for r in result["rows"]]  # type: ignore[attr-defined]
    assert min(read) > 4 * 0.005 * 0.9  # the sleeps, per batch of 4, in every row


def test_a_fast_in_memory_dataset_is_advised_no_workers_and_the_report_is_written(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    result = bench(
        capsys, "tests.test_bench_cli:fast", "--workers", "0,2", "--report", str(tmp_path)
    )
    assert "no-workers" in codes(result) and "more-workers" not in codes(result)
    assert json.loads((tmp_path / "bench.json").read_text())["advice"] == result["advice"]
    assert (tmp_path / "bench.png").read_bytes()[:4] == b"\x89PNG"


def test_a_bad_factory_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "tests.test_bench_cli:SlowRead", "--workers", "0"]) == 2
    err = capsys.readouterr().err
    assert "must return an evenly.Dataset" in err and "SlowRead" in err


def row(workers: int, rate: float, **stages: float) -> Row:
    return Row("processes", workers, rate, 0.95, {"read": 0.0, "transform": 0.0, **stages})


def test_the_advice_names_the_format_the_shuffle_and_the_seeding() -> None:
    reading = [row(0, 500.0, read=0.9), row(2, 1000.0, read=0.9)]
    parquet = Facts(source="ParquetSource", shuffle="global", seeded=False, sharded=True)
    assert codes({"advice": [a.__dict__ for a in advise(reading, parquet)]}) == [
        "more-workers",
        "arrow",
        "block-shuffle",
        "columnar",
    ]
    arrow = Facts(source="ArrowSource", shuffle="block", seeded=False, columnar=True)
    assert [a.code for a in advise(reading, arrow)] == ["more-workers"]
    seeded = Facts(source="list", shuffle="global", seeded=True)
    transforming = [row(0, 900.0, transform=0.5), row(2, 1000.0, transform=0.5)]
    assert [a.code for a in advise(transforming, seeded)] == ["no-workers", "seed-generators"]


def test_a_link_bound_loader_is_advised_the_cache_and_concurrency_not_another_format() -> None:
    """Waits for downloads are the fetch stage (not read or decode): when they dominate,
    the advice names ``max_in_flight`` and ``cache_bytes``, not Arrow files."""
    fetching = [row(0, 900.0, fetch=0.8, read=0.05, decode=0.05), row(2, 1000.0, fetch=0.8)]
    parquet = Facts(source="ParquetSource", shuffle="block", seeded=False, sharded=True)
    advice = advise(fetching, parquet)
    assert [a.code for a in advice] == ["no-workers", "fetch-bound"]
    assert "max_in_flight" in advice[1].text and "cache_bytes" in advice[1].text
