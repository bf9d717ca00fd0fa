"""The ``evenly audit`` subcommand.

``register(subparsers)`` adds it to an ``argparse`` parser (``evenly.cli`` does that);
``python -m evenly.audit ...`` runs it on its own.  Exit status: 0 when no finding is
FAIL, 1 when one is, 2 when the audit could not run (bad factory path, failing rank,
timeout: every process the audit started is stopped, DataLoader workers included).

    evenly audit examples.talk_attempts:naive --workers 4 --world-size 2 --epochs 2 \\
        --batch-size 10 [--nodes N] [--json] [--report DIR] [--junit FILE]
        [--shard-fn mod:fn] [--id-fn mod:fn]
        [--resume [--resume-world-size N] [--resume-workers K] [--resume-nodes M]]
    evenly audit --peer litdata --data DIR [--resume]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

__all__ = ["DESCRIPTION", "add_arguments", "main", "register", "run"]

DESCRIPTION = """\
Run a dataset factory under real DDP ranks (gloo on 127.0.0.1) and real DataLoader
workers, record every sample delivered, and check it: duplicates and missing samples
per epoch, per-rank sample and batch counts, partial batches, an order repeated from the
previous epoch, shuffle quality, random streams shared by workers or ranks, len().  For
an evenly.Dataset over an evenly.Mix: samples per source per epoch against mix.counts,
and duplicates/missing judged per source stream.  With --resume: every rank stops at a
few batches (early, middle, the last batch, the epoch boundary, a second resume), saves
the loader's state, and fresh processes load it and finish; the rest is compared with
the uninterrupted run (missing, repeated, reordered, wrong epoch).  With --nodes N:
the ranks as N simulated nodes of world-size/N ranks each, with the variables torchrun
gives a multi-node job (GROUP_RANK = node, LOCAL_RANK within it, LOCAL_WORLD_SIZE...)
and, on Linux as root, each node's own host name (evenly-node-<n>): a dataset that
splits by LOCAL_RANK or host name repeats its data on every node, and it shows.

examples:
  evenly audit examples.talk_attempts:naive --workers 4 --world-size 2 --epochs 2
  evenly audit examples.talk_attempts:evenly_dataset --resume --resume-world-size 3
  evenly audit examples.talk_attempts:evenly_dataset --world-size 4 --nodes 2
  evenly audit --peer litdata --data DIR --resume

exit status: 0 when no finding is FAIL, 1 when one is, 2 when the audit could not run.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The audit's arguments, on any parser."""
    parser.add_argument(
        "factories",
        nargs="*",
        metavar="module.path:factory",
        help="callable returning the rank's dataset, (dataset, dataloader_kwargs) or an "
        "evenly.audit.LoaderFactory",
    )
    parser.add_argument(
        "--peer",
        action="append",
        default=[],
        metavar="NAME",
        help="audit a peer loader by name, over --data (see docs/peers.md; repeatable)",
    )
    parser.add_argument("--data", default=None, metavar="DIR", help="the data of --peer")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="also stop at a few batches, save the state, resume in fresh processes",
    )
    parser.add_argument("--resume-world-size", type=int, default=None, help="ranks to resume onto")
    parser.add_argument(
        "--resume-workers", type=int, default=None, help="workers per rank to resume onto"
    )
    parser.add_argument(
        "--resume-nodes",
        type=int,
        default=None,
        help="simulated nodes to resume onto (default: --nodes; must divide the resumed "
        "world size)",
    )
    parser.add_argument(
        "--junit", default=None, metavar="FILE", help="write the findings as JUnit XML"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers per rank")
    parser.add_argument("--world-size", type=int, default=2, help="rank processes (gloo)")
    parser.add_argument(
        "--nodes",
        type=int,
        default=1,
        help="simulated nodes the ranks are split over (must divide --world-size): "
        "torchrun's multi-node variables per rank, and each node's own host name as root "
        "on Linux",
    )
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=10)
    parser.add_argument(
        "--expected",
        type=int,
        default=None,
        help="distinct samples per epoch over all ranks (default: from len())",
    )
    parser.add_argument(
        "--id-fn",
        default=None,
        metavar="module:function",
        help="names a sample (default: the sample, or its __key__/idx/id)",
    )
    parser.add_argument(
        "--shard-fn",
        default=None,
        metavar="module:function",
        help="maps an id to its shard/group, to measure same-shard neighbours",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument(
        "--report",
        default=None,
        metavar="DIR",
        help="write DIR/index.html with PNG plots (one subfolder per factory "
        "when several are given); needs pip install 'evenly[report]'",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        help="seconds before a stuck audit is stopped, with every rank process and "
        "DataLoader worker it started (exit status 2)",
    )


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``audit`` to the ``subparsers`` of a CLI; the parser's ``func`` runs it."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "audit",
        help="run a dataset under real DDP ranks and DataLoader workers and check it",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Run the audit described by parsed ``args``; return the exit status."""
    import json
    from pathlib import Path

    from rich.console import Console
    from rich.markup import escape

    from ._api import audit_many
    from ._factory import resolve
    from ._report import require_matplotlib
    from ._table import mix_table, result_table
    from ._types import AuditError

    # Like ``python -m``: factories are importable from the current directory.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    err = Console(stderr=True)
    try:
        if args.report:
            require_matplotlib()  # before the audit runs, not after
        id_fn = resolve(args.id_fn) if args.id_fn else None
        shard_fn = resolve(args.shard_fn) if args.shard_fn else None
        factories: list[Any] = list(args.factories)
        if args.peer:
            from .peers import peer_factory

            if args.data is None:
                raise AuditError("--peer needs --data DIR (the folder of the peer's data)")
            factories += [peer_factory(name, args.data) for name in args.peer]
        if not factories:
            raise AuditError("name a factory (module.path:factory) or a --peer")
        with _progress(err, enabled=not args.no_progress) as say:
            results = audit_many(
                factories,
                num_workers=args.workers,
                world_size=args.world_size,
                epochs=args.epochs,
                batch_size=args.batch_size,
                id_fn=id_fn,
                shard_fn=shard_fn,
                expected=args.expected,
                timeout=args.timeout,
                resume=args.resume,
                resume_world_size=args.resume_world_size,
                resume_workers=args.resume_workers,
                progress=say,
                nodes=args.nodes,
                resume_nodes=args.resume_nodes,
            )
    except KeyboardInterrupt:
        err.print("evenly audit: interrupted; every process it started was stopped")
        return 130
    except (AuditError, ValueError) as exc:
        # escape: "[report]" in a message is text, not rich markup.
        err.print(f"[bold red]evenly audit: error:[/] {escape(str(exc))}", highlight=False)
        return 2
    if args.json:
        payload: Any = [r.to_dict() for r in results]
        print(json.dumps(payload[0] if len(payload) == 1 else payload, indent=2))
    else:
        out = Console()
        for r in results:
            out.print(result_table(r))
            per_source = mix_table(r)
            if per_source is not None:
                out.print(per_source)
    if args.junit:
        from ._junit import write_junit

        err.print(f"junit: {write_junit(results, args.junit)}", highlight=False)
    if args.report:
        for i, r in enumerate(results):
            folder = Path(args.report)
            if len(results) > 1:
                folder = folder / f"{i}-{r.factory.split(':')[-1].split('(')[0]}"
            page = r.write_report(folder)
            err.print(f"report: {page}", highlight=False)
    return 0 if all(r.ok for r in results) else 1


@contextlib.contextmanager
def _progress(console: Any, *, enabled: bool) -> Iterator[Callable[[str], None] | None]:
    """A rich status line on stderr naming the audit's current phase (only on a
    terminal: none in tests, pipes or CI logs)."""
    if not enabled or not console.is_terminal:
        yield None
        return
    with console.status("evenly audit: starting") as status:
        yield lambda text: status.update(f"evenly audit: {text}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="evenly audit",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))
