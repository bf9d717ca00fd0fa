"""How long ``evenly audit`` takes on a 100,000-sample dataset with 2 ranks x 2 workers x
2 epochs (goal: 10 s or less on an idle 2-core machine; exit status 1 past 60 s), end to
end: starting the ranks, running the DataLoader workers, shipping the records back and
computing every finding (no --resume, no --report).

    python bench/bench_audit.py [--size 100000] [--batch-size 10] [--report DIR]

The dataset is ``evenly.Dataset(range(size), shuffle=True)`` (``examples.talk_attempts:
evenly_dataset``), so the audit also has to find nothing wrong.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import examples.talk_attempts as talk  # noqa: E402

from evenly.audit import run  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=100_000)
    parser.add_argument("--batch-size", type=int, default=10)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--report", default=None, help="also time writing the HTML report")
    args = parser.parse_args()
    start = time.perf_counter()
    result = run(
        functools.partial(talk.evenly_dataset, size=args.size),
        num_workers=args.workers,
        world_size=args.world_size,
        epochs=args.epochs,
        batch_size=args.batch_size,
        shard_fn=talk.folder_of,
    )
    elapsed = time.perf_counter() - start
    delivered = len(result.records)
    print(
        f"audit of {args.size:,} samples, {args.world_size} ranks x {args.workers} workers x "
        f"{args.epochs} epochs, batch size {args.batch_size}, on {os.cpu_count()} cores: "
        f"{elapsed:.1f} s ({delivered:,} deliveries, {delivered / elapsed:,.0f}/s), "
        f"{'OK' if result.ok else 'FAIL'}"
    )
    for f in result.findings:
        print(f"  {f.status:4} {f.title}: {f.detail}")
    if args.report:
        t0 = time.perf_counter()
        result.write_report(args.report)
        print(f"report written to {args.report} in {time.perf_counter() - t0:.1f} s")
    return 0 if result.ok and elapsed < 60 else 1


if __name__ == "__main__":
    sys.exit(main())
