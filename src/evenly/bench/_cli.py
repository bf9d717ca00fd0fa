"""The ``evenly bench`` subcommand: measure, print the table and the advice, and with
``--report DIR`` write ``bench.json`` and a plot ``bench.png`` (matplotlib: ``pip install
'evenly[report]'``).  Exit status 0, or 2 when the dataset could not be run."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from evenly.bench._advice import Advice, Row, advise
from evenly.bench._run import MODES, facts_of, measure, split_factory_result

__all__ = ["default_workers", "register", "run_bench"]


def default_workers() -> list[int]:
    """0, 1, 2, 4 ... up to the number of CPUs."""
    cpus, out, w = os.cpu_count() or 1, [0, 1], 2
    while w <= cpus:
        out.append(w)
        w *= 2
    return out


def _int_list(text: str) -> list[int]:
    try:
        values = sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers like 0,2,4, got {text!r}") from None
    if not values or values[0] < 0:
        raise argparse.ArgumentTypeError(f"worker counts must be >= 0, got {text!r}")
    return values


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``bench`` subcommand; its handler is ``args.handler(args) -> int``."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "bench",
        help="measure a dataset under 0..k workers and advise",
        description=__doc__,
    )
    parser.add_argument(
        "factory",
        metavar="module.path:factory",
        help="returns an evenly.Dataset, or (dataset, evenly.DataLoader kwargs)",
    )
    parser.add_argument("--batches", type=int, default=50, help="timed batches per row")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument(
        "--workers", type=_int_list, default=None, help="worker counts (default 0,1,2,4.. CPUs)"
    )
    parser.add_argument(
        "--modes", default="processes", help=f"comma-separated, of {', '.join(sorted(MODES))}"
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--report", metavar="DIR", help="write bench.json and bench.png there")
    parser.set_defaults(handler=run_bench)
    return parser


def run_bench(args: argparse.Namespace) -> int:
    """Run ``evenly bench`` with parsed ``args``; returns the exit code."""
    from evenly.sources._cli import load_object

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown or args.batches < 1 or args.batch_size < 1:
        why = f"unknown mode(s) {unknown}; choose from {sorted(MODES)}" if unknown else ""
        print(f"evenly bench: {why or '--batches and --batch-size must be >= 1'}", file=sys.stderr)
        return 2
    try:
        dataset, kwargs = split_factory_result(load_object(args.factory), args.factory)
    except (ImportError, ValueError, TypeError) as exc:
        print(f"evenly bench: cannot load {args.factory!r}: {exc}", file=sys.stderr)
        return 2
    rows = [
        measure(
            dataset,
            kwargs,
            mode=mode,
            workers=workers,
            batches=args.batches,
            batch_size=args.batch_size,
        )
        for mode in modes
        for workers in args.workers or default_workers()
    ]
    advice = advise(rows, facts_of(dataset, kwargs))
    result = {
        "factory": args.factory,
        "batch_size": args.batch_size,
        "batches": args.batches,
        "rows": [asdict(r) for r in rows],
        "advice": [asdict(a) for a in advice],
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _print_table(rows, advice)
    if args.report:
        os.makedirs(args.report, exist_ok=True)
        with open(os.path.join(args.report, "bench.json"), "w") as f:
            json.dump(result, f, indent=2)
        _plot(rows, os.path.join(args.report, "bench.png"))
    return 0


def _print_table(rows: Sequence[Row], advice: Sequence[Advice]) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    table = Table(title="evenly bench (stage times: ms per batch, summed over workers)")
    for name in ("mode", "workers", "samples/s"):
        table.add_column(name, justify="right")
    stages = list(rows[0].stages) if rows else []
    for stage in stages:
        table.add_column(stage, justify="right")
    for r in rows:
        table.add_row(
            r.mode,
            str(r.workers),
            f"{r.samples_per_second:,.0f}",
            *(f"{r.stages[s] * 1e3:.2f}" for s in stages),
        )
    console = Console()
    if not console.is_terminal:  # a pipe or a file: no need to fit 80 columns
        console = Console(width=120)
    console.print(table)
    for a in advice or [Advice("none", "no advice: this configuration looks fine")]:
        console.print(f"- {escape(a.text)}")


def _plot(rows: Sequence[Row], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise SystemExit(
            f"evenly bench --report needs matplotlib: pip install 'evenly[report]' ({exc})"
        ) from exc
    labels = [f"{r.mode}\n{r.workers} w" for r in rows]
    fig, (rate, stage) = plt.subplots(1, 2, figsize=(11, 4))
    rate.bar(labels, [r.samples_per_second for r in rows], color="tab:blue")
    rate.set_ylabel("samples/s")
    rate.set_title("throughput")
    bottom = [0.0] * len(rows)
    for name in rows[0].stages if rows else []:
        values = [r.stages[name] * 1e3 for r in rows]
        stage.bar(labels, values, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    stage.set_ylabel("ms per batch (summed over workers)")
    stage.set_title("where the workers' time goes")
    stage.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
