"""What the integrity checks cost: paired micro-benchmarks, not an end-to-end run.

1. Parquet page checksums: the same files (written by ``evenly.write``, so with page
   checksums; in the page cache) read row group by row group as ``from_parquet`` reads
   them (one thread), with ``page_checksum_verification`` off and on, alternating which
   goes first, ``--rounds`` rounds; the row is the median of the per-round ratios.
2. The decoded-row cache's entry checksum: the same entries mapped with and without the
   CRC-32 check (the check reads every byte once; a mapping alone reads none), next to
   what a miss costs instead (decoding the row group from Parquet).  The check is paid
   once per process per entry it maps (a process keeps its mapped entries).

    python bench/bench_checksums.py            # ~1 min

Times are CPU seconds of the process (all its threads): the reads are from the page
cache, so CPU-bound, and CPU time is what other work on a busy machine does not inflate.

Two workloads: ``payload`` (an int64 id and 1 KiB of random bytes per row, as in
``bench_formats.py``) and ``tokens`` (an int32 list of 512 token ids per row, as packing
reads).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

import evenly.sources as es
from evenly.sources import _rowcache
from evenly.sources._rowcache import RowCache


def workload(name: str, out: str, rows: int) -> list[str]:
    rng = np.random.default_rng(0)
    if name == "payload":
        data = rng.integers(0, 256, size=(rows, 1024), dtype=np.uint8)
        samples: Any = ({"id": i, "payload": data[i].tobytes()} for i in range(rows))
    else:
        ids = rng.integers(0, 50_000, size=(rows, 512), dtype=np.int32)
        samples = ({"input_ids": ids[i]} for i in range(rows))
        schema = pa.schema([("input_ids", pa.list_(pa.int32()))])
        return es.write(samples, out, rows_per_shard=rows // 8, schema=schema, progress=False)
    return es.write(samples, out, rows_per_shard=rows // 8, progress=False)


def read_all(paths: list[str], verify: bool) -> float:
    started = time.process_time()
    for path in paths:
        with pq.ParquetFile(path, page_checksum_verification=verify) as f:
            for g in range(f.metadata.num_row_groups):
                f.read_row_group(g, use_threads=False)
    return time.process_time() - started


def paired(a: Callable[[], float], b: Callable[[], float], rounds: int) -> list[float]:
    """Per round, ``b() / a()``, alternating which runs first."""
    ratios = []
    for r in range(rounds):
        if r % 2:
            tb, ta = b(), a()
        else:
            ta, tb = a(), b()
        ratios.append(tb / ta)
    return ratios


def map_all(paths: list[str], verify: bool) -> float:
    started = time.process_time()
    for path in paths:
        _rowcache._map(path, verify=verify)
    return time.process_time() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=32_768)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    print(f"{args.rows} rows per workload, {args.rounds} paired rounds, medians [min-max]")
    for name in ("payload", "tokens"):
        with tempfile.TemporaryDirectory() as tmp:
            paths = workload(name, os.path.join(tmp, "data"), args.rows)
            size = sum(os.path.getsize(p) for p in paths)
            read_all(paths, False)  # into the page cache
            off = statistics.median(read_all(paths, False) for _ in range(3))
            ratios = paired(
                lambda p=paths: read_all(p, False),
                lambda p=paths: read_all(p, True),
                args.rounds,
            )
            print(
                f"{name}: Parquet {size >> 20} MiB, read at {size / off / 2**20:.0f} MiB/s of CPU "
                f"unverified; verified / unverified = {statistics.median(ratios):.3f} "
                f"[{min(ratios):.3f}-{max(ratios):.3f}]"
            )
            # the decoded-row cache: one entry per row group
            cache = RowCache(os.path.join(tmp, "cache"), 1 << 40)
            src = es.from_parquet(os.path.join(tmp, "data"), decoded_cache_bytes=0)
            keys = [(k, g) for k in range(len(src.urls)) for g in range(len(src._chunk_rows[k]))]
            decode_s = 0.0
            entries = []
            for k, g in keys:
                handle = pq.ParquetFile(src.urls[k])
                started = time.process_time()
                table = handle.read_row_group(g, use_threads=False)
                decode_s += time.process_time() - started
                key = (src.urls[k], "bench", g, None)
                cache.get(key, table.num_rows, lambda t=table: t)
                entries.append(cache.path_for(key))
            decoded = sum(os.path.getsize(p) for p in entries)
            map_all(entries, True)  # into the page cache
            plain = statistics.median(map_all(entries, False) for _ in range(args.rounds))
            checked = paired(
                lambda e=entries: map_all(e, False) + 1e-9,
                lambda e=entries: map_all(e, True),
                args.rounds,
            )
            check_s = statistics.median(
                map_all(entries, True) - map_all(entries, False) for _ in range(args.rounds)
            )
            print(
                f"{name}: decoded-row cache, {len(entries)} entries, {decoded >> 20} MiB: "
                f"mapping {plain / len(entries) * 1e6:.0f} us/entry unchecked, the CRC-32 "
                f"check adds {check_s / len(entries) * 1e6:.0f} us/entry "
                f"({decoded / check_s / 2**30:.1f} GiB/s; x{statistics.median(checked):.0f} a "
                f"bare mapping), {check_s / decode_s:.1%} of decoding the same row groups "
                f"({decode_s / len(entries) * 1e3:.1f} ms/row group)"
            )


if __name__ == "__main__":
    main()
