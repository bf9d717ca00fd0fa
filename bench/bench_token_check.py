"""The cost of packing's token id checks, per read: a paired micro-benchmark.

``check_tokens`` (non-negative, below ``vocab_size``, never ``pad_id``) against the
``pad_id`` search alone that it replaced, alternated over the same int64 tokens: one
batch of ``bench_packing.py`` (8 x 2048 ids) and one of its read groups (16 MiB of rows:
42 batches), ids drawn from 1..49,999 as there; ``--pad-inside`` puts ``pad_id`` between
the smallest and the largest id read.

    python bench/bench_token_check.py --repeats 300
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from evenly.core.packing.pieces import pieces_of
from evenly.core.packing.settings import Packing
from evenly.runtime.packer import check_tokens


def pad_search(flat: np.ndarray, pad_id: int) -> None:
    """The check before: ``pad_id`` searched for, nothing else."""
    if flat.size and bool((flat == pad_id).any()):
        raise ValueError("pad_id in a document")


def checked(packing: Packing, flat: np.ndarray, pieces: np.ndarray) -> None:
    """The check after (no error expected: the context is only read to name one)."""
    ctx: Any = None
    check_tokens(ctx, packing, flat, pieces, (flat[:0], flat[:0]), 0, lambda pos: None)


def measure(label: str, n: int, pad_id: int, repeats: int) -> None:
    """Print the three checks' times over ``n`` ids, alternated ``repeats`` times."""
    flat = np.random.default_rng(0).integers(1, 50_000, n).astype(np.int64)
    flat[flat == pad_id] = pad_id + 1
    pieces = pieces_of([0], [0], [0], [n])
    plain = Packing(2048, pad_id=pad_id)
    sized = Packing(2048, pad_id=pad_id, vocab_size=50_000)
    calls: dict[str, Callable[[], None]] = {
        "pad_id search (before)": lambda: pad_search(flat, pad_id),
        "check_tokens": lambda: checked(plain, flat, pieces),
        "check_tokens, vocab_size": lambda: checked(sized, flat, pieces),
    }
    times: dict[str, list[float]] = {k: [] for k in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            t = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - t)
    print(f"{label} ({n:,} ids):")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"  {name:<26} {med * 1e6:8.1f} us [{min(ts) * 1e6:.1f}]  {med / n * 1e9:.3f} ns/id")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=300)
    p.add_argument("--pad-inside", action="store_true")
    a = p.parse_args()
    pad_id = 7 if a.pad_inside else 0
    print(f"pad_id {pad_id}; median [min] over {a.repeats} alternated repeats")
    for label, n in (("one batch", 8 * 2048), ("one read group", 42 * 8 * 2048)):
        measure(label, n, pad_id, a.repeats)


if __name__ == "__main__":
    main()
