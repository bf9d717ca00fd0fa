"""The ``evenly`` command line: ``evenly write`` packs data into shards, ``evenly audit``
checks any dataset for the pitfalls of iterable datasets under workers and DDP, ``evenly
bench`` measures a dataset under 0..k workers and says what would make it faster.

    evenly write mypkg.data:samples out/ --format parquet --rows-per-shard 10000
    evenly audit examples.talk_attempts:naive --workers 4 --world-size 2 --epochs 2
    evenly bench mypkg.data:make_dataset --batches 100 --batch-size 64
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any


def build_parser() -> argparse.ArgumentParser:
    from evenly.audit._cli import register as register_audit
    from evenly.bench._cli import register as register_bench
    from evenly.sources._cli import register as register_write

    parser = argparse.ArgumentParser(
        prog="evenly", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    subparsers = parser.add_subparsers(dest="command", required=True)
    register_write(subparsers)
    register_audit(subparsers)
    register_bench(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handler: Any = getattr(args, "handler", None) or getattr(args, "func", None)
    return int(handler(args))


if __name__ == "__main__":
    sys.exit(main())
