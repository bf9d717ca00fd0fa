"""``evenly write``: pack a dataset named on the command line into shards.

    evenly write mypkg.data:make_dataset out/ --format parquet --rows-per-shard 10000

``module:name`` names an iterable, a map-style dataset, or a function of no argument
that returns one.  The lead's ``evenly.cli`` calls :func:`register` on its subparsers.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Any

from ._write import FORMATS, write

__all__ = ["load_object", "register", "run_write"]


def load_object(spec: str) -> Any:
    """Import ``module:name`` (``name`` may be dotted) and call it if it is a function."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"expected 'module:name', got {spec!r} (e.g. 'mypkg.data:make_dataset')")
    if "" not in sys.path:
        sys.path.insert(0, "")  # like `python -m`: modules in the current directory
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"{module_name!r} has no attribute {attr!r}") from None
    if callable(obj) and not hasattr(obj, "__getitem__") and not hasattr(obj, "__iter__"):
        obj = obj()
    return obj


def run_write(args: argparse.Namespace) -> int:
    """Run ``evenly write`` with parsed ``args``; returns the exit code."""
    try:
        data = load_object(args.source)
    except (ImportError, ValueError) as exc:
        print(f"evenly write: cannot load {args.source!r}: {exc}", file=sys.stderr)
        return 2
    paths = write(
        data,
        args.out_dir,
        format=args.format,
        rows_per_shard=args.rows_per_shard,
        row_group_size=args.row_group_size,
        prefix=args.prefix,
        progress=False if args.no_progress else (True if args.progress else None),
    )
    print(f"wrote {len(paths)} {args.format} shard(s) and a manifest to {args.out_dir}")
    return 0


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``write`` subcommand; its handler is ``args.handler(args) -> int``."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "write",
        help="pack a dataset into Parquet / WebDataset / JSONL shards plus a manifest",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("source", help="module:name of an iterable, dataset, or factory")
    parser.add_argument("out_dir", help="output directory (created if needed)")
    parser.add_argument("--format", choices=sorted(FORMATS), default="parquet")
    parser.add_argument("--rows-per-shard", type=int, default=10_000)
    parser.add_argument("--row-group-size", type=int, default=None, help="Parquet only")
    parser.add_argument("--prefix", default="shard", help="shard name prefix")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    parser.add_argument(
        "--progress", action="store_true", help="show it even when stderr is not a terminal"
    )
    parser.set_defaults(handler=run_write)
    return parser
