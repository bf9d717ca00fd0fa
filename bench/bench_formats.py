"""Throughput of evenly's file-format sources vs the streaming libraries people use.

Every contender reads the same samples (``{"id": int, "payload": 1 KiB of random
bytes}``, 200,000 of them in 64 shards by default) in its own format, shuffled, with a
torch DataLoader of 2 workers and batch 256:

- evenly over Parquet and over WebDataset tar (global shuffle, and block shuffle K=8);
- HF ``datasets`` streaming (Parquet, shard shuffle + 10,000-sample buffer);
- ``webdataset`` (tar, shard shuffle + 10,000-sample buffer);
- ``litdata`` (its chunks, ``StreamingDataset(shuffle=True)``);
- ``mosaicml-streaming`` (MDS, ``StreamingDataset(shuffle=True)``);
- a ceiling: a map-style DataLoader over an in-memory list.

Each (contender, repeat) runs in a fresh subprocess; the parent samples the RSS of that
process tree (psutil; shared pages of forked workers count once per process, as RSS
does).  Reported: median samples/s of ``--repeats`` runs (one epoch, timed from
``iter(loader)`` to the last batch, worker start included), peak RSS, the ratio to the
fastest peer, and how many sample ids were missing or repeated in the epoch.

    bash bench/setup_peers.sh               # peers; the ones not installed are skipped
    python bench/bench_formats.py           # or --samples 20000 --repeats 1 for a smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

EVENLY = ["evenly-parquet", "evenly-parquet-block8", "evenly-tar", "evenly-tar-block8"]
PEERS = ["hf-datasets", "webdataset", "litdata", "mosaic-streaming"]
CEILING = "map-style-in-memory"
ALL = [*EVENLY, *PEERS, CEILING]
PAYLOAD = 1024


# ---- data ------------------------------------------------------------------------
def payloads(data_dir: str) -> np.ndarray:
    return np.memmap(os.path.join(data_dir, "payload.bin"), dtype=np.uint8, mode="r")


def sample(buf: np.ndarray, i: int) -> dict[str, Any]:
    return {"id": i, "payload": bytes(buf[i * PAYLOAD : (i + 1) * PAYLOAD])}


def _litdata_item(i: int) -> dict[str, Any]:
    return sample(payloads(os.environ["EVENLY_BENCH_DATA"]), i)


def prepare(data_dir: str, n: int, shards: int, names: list[str]) -> None:
    os.makedirs(data_dir, exist_ok=True)
    path = os.path.join(data_dir, "payload.bin")
    if not os.path.exists(path) or os.path.getsize(path) != n * PAYLOAD:
        np.random.default_rng(0).integers(0, 256, n * PAYLOAD, dtype=np.uint8).tofile(path)
    buf = payloads(data_dir)
    per = -(-n // shards)
    import evenly.sources as es

    def once(sub: str, make: Callable[[str], None]) -> None:
        out = os.path.join(data_dir, sub)
        if not os.path.exists(os.path.join(out, ".done")):
            print(f"preparing {sub} ...", file=sys.stderr)
            make(out)
            open(os.path.join(out, ".done"), "w").close()

    rows = lambda: (sample(buf, i) for i in range(n))  # noqa: E731
    if any(x in names for x in ("evenly-parquet", "evenly-parquet-block8", "hf-datasets")):
        once("parquet", lambda o: es.write(rows(), o, "parquet", per, progress=False))
    if any(x in names for x in ("evenly-tar", "evenly-tar-block8", "webdataset")):
        once("tar", lambda o: es.write(rows(), o, "webdataset", per, progress=False))
    if "litdata" in names and _importable("litdata"):
        import litdata

        def make_lit(out: str) -> None:
            os.environ["EVENLY_BENCH_DATA"] = data_dir
            litdata.optimize(
                fn=_litdata_item,
                inputs=list(range(n)),
                output_dir=out,
                chunk_size=per,
                num_workers=1,
                mode="overwrite",
            )

        once("litdata", make_lit)
    if "mosaic-streaming" in names and _importable("streaming"):
        _streaming()
        from streaming import MDSWriter

        def make_mds(out: str) -> None:
            columns = {"id": "int", "payload": "bytes"}
            with MDSWriter(out=out, columns=columns, size_limit=per * (PAYLOAD + 64)) as w:
                for s in rows():
                    w.write(s)

        once("mds", make_mds)


def _importable(name: str) -> bool:
    try:
        if name == "streaming":
            _streaming()
        else:
            __import__(name)
        return True
    except Exception:
        return False


def _streaming() -> Any:
    """Import mosaicml-streaming without torchvision: its ``streaming.vision`` subpackage
    (CIFAR, ImageNet helpers) imports torchvision at import time; the bench needs none of
    it, so it stands in an empty module for it."""
    import types

    sys.modules.setdefault("streaming.vision", types.ModuleType("streaming.vision"))
    import streaming

    return streaming


# ---- loaders (in the child process) ------------------------------------------------
def _collate(batch: list[dict[str, Any]]) -> dict[str, Any]:
    return {"id": np.array([int(s["id"]) for s in batch]), "payload": [s["payload"] for s in batch]}


def loader_for(name: str, data_dir: str, workers: int, batch: int) -> Iterable[Any]:
    import torch.utils.data as tud

    n_shards = lambda sub, ext: sorted(glob.glob(os.path.join(data_dir, sub, "*" + ext)))  # noqa: E731
    if name.startswith("evenly-"):
        import evenly
        import evenly.sources as es

        src: Any = (
            es.from_parquet(os.path.join(data_dir, "parquet"))
            if "parquet" in name
            else es.from_webdataset(os.path.join(data_dir, "tar"))
        )
        mode = "block" if name.endswith("block8") else "global"
        ds = evenly.Dataset(src, shuffle=mode, block_shards=8)
        return evenly.DataLoader(ds, batch_size=batch, num_workers=workers, collate_fn=_collate)
    if name == "hf-datasets":
        import datasets

        files = n_shards("parquet", ".parquet")
        hf = datasets.load_dataset("parquet", data_files=files, split="train", streaming=True)
        hf = hf.shuffle(seed=0, buffer_size=10_000)
        return tud.DataLoader(hf, batch_size=batch, num_workers=workers, collate_fn=_collate)
    if name == "webdataset":
        import webdataset as wds

        urls = n_shards("tar", ".tar")
        w = wds.WebDataset(urls, shardshuffle=len(urls), nodesplitter=wds.single_node_only)
        w = w.shuffle(10_000)
        return tud.DataLoader(w, batch_size=batch, num_workers=workers, collate_fn=_collate)
    if name == "litdata":
        import litdata

        lit = litdata.StreamingDataset(os.path.join(data_dir, "litdata"), shuffle=True, seed=0)
        return litdata.StreamingDataLoader(
            lit, batch_size=batch, num_workers=workers, collate_fn=_collate
        )
    if name == "mosaic-streaming":
        streaming = _streaming()
        from streaming.base.util import clean_stale_shared_memory

        clean_stale_shared_memory()
        mds = streaming.StreamingDataset(
            local=os.path.join(data_dir, "mds"), shuffle=True, shuffle_seed=0, batch_size=batch
        )
        return tud.DataLoader(mds, batch_size=batch, num_workers=workers, collate_fn=_collate)
    if name == CEILING:
        buf = payloads(data_dir)
        items = [sample(buf, i) for i in range(len(buf) // PAYLOAD)]
        return tud.DataLoader(
            items, batch_size=batch, shuffle=True, num_workers=workers, collate_fn=_collate
        )
    raise ValueError(f"unknown contender {name!r}; choose from {ALL}")


def child(name: str, data_dir: str, workers: int, batch: int) -> None:
    loader = loader_for(name, data_dir, workers, batch)
    ids: list[np.ndarray] = []
    t0 = time.perf_counter()
    for b in loader:
        ids.append(np.asarray(b["id"]))
    seconds = time.perf_counter() - t0
    all_ids = np.concatenate(ids) if ids else np.zeros(0, np.int64)
    n = len(payloads(data_dir)) // PAYLOAD
    unique = np.unique(all_ids)
    print(
        json.dumps(
            {
                "samples": int(all_ids.size),
                "seconds": seconds,
                "missing": int(n - unique.size),
                "repeated": int(all_ids.size - unique.size),
            }
        )
    )


# ---- parent ----------------------------------------------------------------------------
def run_one(name: str, args: argparse.Namespace) -> dict[str, Any]:
    import psutil

    cmd = [sys.executable, __file__, "--child", name, "--data-dir", args.data_dir,
           "--workers", str(args.workers), "--batch-size", str(args.batch_size)]  # fmt: skip
    env = {**os.environ, "EVENLY_BENCH_DATA": args.data_dir, "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    peak = 0
    done = threading.Event()

    def sample_rss() -> None:
        nonlocal peak
        try:
            root = psutil.Process(proc.pid)
        except psutil.NoSuchProcess:
            return
        while not done.is_set():
            total = 0
            try:
                for p in [root, *root.children(recursive=True)]:
                    with contextlib.suppress(psutil.NoSuchProcess):
                        total += p.memory_info().rss
            except psutil.NoSuchProcess:
                break
            peak = max(peak, total)
            time.sleep(0.05)

    watcher = threading.Thread(target=sample_rss, daemon=True)
    watcher.start()
    out, err = proc.communicate(timeout=args.timeout)
    done.set()
    watcher.join()
    if proc.returncode != 0:
        last = err.strip().splitlines()[-1] if err.strip() else f"exit {proc.returncode}"
        return {"error": last}
    result = json.loads(out.strip().splitlines()[-1])
    result["peak_rss_mb"] = peak / 2**20
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--samples", type=int, default=200_000)
    ap.add_argument("--shards", type=int, default=64)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--data-dir", default=os.path.join("/tmp", "evenly-bench"))
    ap.add_argument("--only", default=",".join(ALL), help="comma-separated contenders")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.data_dir, args.workers, args.batch_size)
        return
    args.data_dir = os.path.join(args.data_dir, f"n{args.samples}-s{args.shards}")
    names = [x for x in args.only.split(",") if x]
    unknown = sorted(set(names) - set(ALL))
    if unknown:
        ap.error(f"unknown contenders {unknown}; choose from {ALL}")
    module = {"hf-datasets": "datasets", "webdataset": "webdataset", "litdata": "litdata",
              "mosaic-streaming": "streaming"}  # fmt: skip
    skipped = {x: "not installed" for x in names if x in module and not _importable(module[x])}
    names = [x for x in names if x not in skipped]
    prepare(args.data_dir, args.samples, args.shards, names)
    print(
        f"{args.samples:,} samples of {PAYLOAD} B in {args.shards} shards, {args.workers} "
        f"workers, batch {args.batch_size}, shuffle on, median of {args.repeats} run(s)"
    )
    results: dict[str, dict[str, Any]] = {}
    for name in names:
        runs = [run_one(name, args) for _ in range(args.repeats)]
        ok = [r for r in runs if "error" in r] == []
        if not ok:
            results[name] = {"error": next(r["error"] for r in runs if "error" in r)}
            continue
        rates = [r["samples"] / r["seconds"] for r in runs]
        results[name] = {
            "rate": statistics.median(rates),
            "rss": max(r["peak_rss_mb"] for r in runs),
            "missing": max(r["missing"] for r in runs),
            "repeated": max(r["repeated"] for r in runs),
        }
        print(f"  done {name}: {results[name]['rate']:,.0f} samples/s", file=sys.stderr)
    peer_rates = [r["rate"] for k, r in results.items() if k in PEERS and "rate" in r]
    best_peer = max(peer_rates) if peer_rates else None
    print(f"{'contender':<24} {'samples/s':>11} {'vs best peer':>13} {'peak RSS MiB':>13} "
          f"{'missing':>8} {'repeated':>9}")  # fmt: skip
    for name, r in results.items():
        if "error" in r:
            print(f"{name:<24} failed: {r['error']}")
            continue
        ratio = f"{r['rate'] / best_peer:.2f}x" if best_peer else "-"
        print(f"{name:<24} {r['rate']:>11,.0f} {ratio:>13} {r['rss']:>13,.0f} "
              f"{r['missing']:>8} {r['repeated']:>9}")  # fmt: skip
    for name, why in skipped.items():
        print(f"{name:<24} skipped: {why}")


if __name__ == "__main__":
    main()
