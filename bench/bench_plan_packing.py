"""Planning an epoch of packed rows at LLM scale: time and peak private memory.

Document lengths (log-normal, median ~500 tokens, one int32 each) are written once to a
memory-mapped file, as evenly's lengths cache holds them; each round plans one epoch in
a fresh subprocess, ``concat`` and ``best_fit`` interleaved, globally shuffled (the
Feistel order, the costliest), into a fresh ``cache_dir``.  Time is wall-clock and the
process's CPU time (user + sys: a shared machine distorts it less).  Memory is the
child's peak private anonymous memory (``RssAnon``: what the process itself allocated,
sampled every 20 ms) above its value just before planning, with its peak PSS beside it
(which also counts the memory-mapped lengths and plan file: file-backed page cache,
shared by every process of the node, and reclaimable).

    python bench/bench_plan_packing.py --docs 100000000 --rounds 3

Pass ``--child`` only internally.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np


def _anon() -> int:
    """This process's resident anonymous memory (bytes), from /proc/self/status."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status (Linux only)")


def _child(lengths_path: str, n: int, strategy: str, seq_len: int) -> None:
    import psutil

    from evenly.core.packing.settings import Packing
    from evenly.core.permutation import FeistelPermutation
    from evenly.runtime.packed_plans import PlanFiles

    proc = psutil.Process()
    lengths = np.memmap(lengths_path, dtype=np.int32, mode="r", shape=(n,))
    base = _anon()
    peak = {"anon": base, "pss": proc.memory_full_info().pss}
    done = threading.Event()

    def sample() -> None:  # RssAnon is cheap to read; PSS (smaps) is read every 0.5 s
        tick = 0
        while not done.is_set():
            peak["anon"] = max(peak["anon"], _anon())
            if tick % 25 == 0:
                peak["pss"] = max(peak["pss"], proc.memory_full_info().pss)
            tick += 1
            time.sleep(0.02)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    t0, c0 = time.perf_counter(), time.process_time()
    if strategy in MIXES:
        rows, tokens = _plan_mix(lengths, n, seq_len, MIXES[strategy])
    else:
        files = PlanFiles(Packing(seq_len, strategy=strategy), lengths, "bench")
        table = files.table(0, (0, "global", 8), FeistelPermutation(n, seed=0, epoch=0))
        rows = table.num_rows
        tokens = int(np.sum(lengths, dtype=np.int64))
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    done.set()
    thread.join()
    print(
        json.dumps(
            {
                "seconds": elapsed,
                "cpu_seconds": cpu,
                "extra_anon_mb": (peak["anon"] - base) / 2**20,
                "peak_pss_mb": peak["pss"] / 2**20,
                "rows": rows,
                "padding": 1 - tokens / (rows * seq_len),
            }
        )
    )


#: The token mixtures planned: the documents cut into equal parts, one per weight (every
#: token once per epoch on average).  ``0.85 / 0.05 * 3`` is merged by deadline.
MIXES = {"mix-tokens": (0.7, 0.3), "mix-tokens-dominant": (0.85, 0.05, 0.05, 0.05)}


def _plan_mix(
    lengths: np.memmap, n: int, seq_len: int, weights: tuple[float, ...]
) -> tuple[int, int]:
    """A Mix by tokens of equal parts of the documents under ``weights``: the merged
    order written to the node's file, then its concat rows."""
    from evenly.core.mix.tokens import ITEM, token_epoch_chunks, token_shares
    from evenly.core.packing.settings import Packing
    from evenly.runtime.packed_plans import PlanFiles
    from evenly.runtime.token_mix import _open_items

    cuts = [n * k // len(weights) for k in range(len(weights) + 1)]
    parts = [lengths[a:b] for a, b in itertools.pairwise(cuts)]
    totals = [int(np.sum(p, dtype=np.int64)) for p in parts]
    shares = token_shares(totals, weights, sum(totals))
    path = os.path.join(os.environ["EVENLY_CACHE_DIR"], "mix.items")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    names = list("abcd")[: len(parts)]
    with open(path, "wb") as f:
        for chunk in token_epoch_chunks(
            parts, shares, seq_len=seq_len, seed=0, epoch=0, shuffle=True, names=names
        ):
            chunk.tofile(f)
    items = _open_items(path, os.path.getsize(path) // ITEM.itemsize, "bench")
    files = PlanFiles(Packing(seq_len), lengths, "bench", sum(shares))
    table = files.table(0, (0, "global", 8), items, items)
    return table.num_rows, sum(shares)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--docs", type=int, default=10**8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--child", nargs=3)
    parser.add_argument("--strategies", default="concat,best_fit,mix-tokens,mix-tokens-dominant")
    args = parser.parse_args()
    if args.child:
        path, n, strategy = args.child
        _child(path, int(n), strategy, args.seq_len)
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "lengths.i32")
        rng = np.random.default_rng(0)
        out = np.memmap(path, dtype=np.int32, mode="w+", shape=(args.docs,))
        for lo in range(0, args.docs, 1 << 22):
            hi = min(lo + (1 << 22), args.docs)
            out[lo:hi] = np.clip(rng.lognormal(np.log(500), 1.0, hi - lo), 1, 2**31 - 1)
        out.flush()
        del out
        results: dict[str, list[dict[str, float]]] = {
            name: [] for name in args.strategies.split(",")
        }
        for r in range(args.rounds):
            for strategy in results:
                env = {**os.environ, "EVENLY_CACHE_DIR": os.path.join(tmp, f"cache-{r}-{strategy}")}
                line = (
                    subprocess.run(
                        [
                            sys.executable,
                            __file__,
                            "--seq-len",
                            str(args.seq_len),
                            "--child",
                            path,
                            str(args.docs),
                            strategy,
                        ],
                        check=True,
                        capture_output=True,
                        text=True,
                        env=env,
                    )
                    .stdout.strip()
                    .splitlines()[-1]
                )
                results[strategy].append(json.loads(line))
                shutil.rmtree(env["EVENLY_CACHE_DIR"])  # a best_fit plan of 10^8 is ~2.4 GB
    print(
        f"planning one epoch of {args.docs:,} documents (seq_len {args.seq_len}, global "
        f"shuffle), {args.rounds} interleaved rounds: median [min, max]"
    )
    for strategy, runs in results.items():
        cells = []
        for key in ("seconds", "cpu_seconds", "extra_anon_mb", "peak_pss_mb"):
            values = [run[key] for run in runs]
            cells.append(
                f"{key} {statistics.median(values):.1f} [{min(values):.1f}, {max(values):.1f}]"
            )
        per_doc = statistics.median(run["cpu_seconds"] for run in runs) / args.docs * 1e9
        print(
            f"  {strategy:19s} "
            + "  ".join(cells)
            + f"  ({per_doc:.0f} CPU ns/document, rows {runs[0]['rows']:,}, "
            f"padding {100 * runs[0]['padding']:.2f}%)"
        )


if __name__ == "__main__":
    main()
