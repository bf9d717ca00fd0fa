"""evenly vs the loaders people use, side by side, in one interleaved run.

Data: ``--samples`` rows (200,000 by default) of ``{"id": int, "payload": 1 KiB of random
bytes}`` in ``--shards`` (64) shards, written once per format under ``--data-dir``.  Every
loader runs with ``--workers`` (2) workers, batch ``--batch-size`` (256),
``persistent_workers=True``; each run is a fresh subprocess that iterates
``--warmup`` untimed epoch(s), then times one epoch (default: epoch 2).  Round r runs every
contender once (the order rotates each round); ``--rounds`` rounds (3).

Three workloads:

- ``sample``: every system does the same per-sample decode in the same place (the same
  ``collate_fn``: bytes -> ``{"id": int64[B], "data": uint8[B, 1024]}``): evenly in
  memory vs a map-style DataLoader + RandomSampler; evenly over Parquet, tar and Arrow
  (global shuffle, and block(8)); a per-sample transform doing the decode (evenly with
  ``seed_generators=("torch",)``, the recommended setting for a torch-only transform, and
  with the default three generators) vs map-style doing it in ``__getitem__``; litdata,
  HF datasets streaming, webdataset and mosaic streaming.
- ``columnar``: batches of tensors ``idx`` int64[B] and ``data`` uint8[B, 1024], each
  system its fastest documented way: evenly Arrow / Parquet (``columnar=True``), litdata
  (numpy items, default collate), map-style over a numpy memmap with batched indexing
  (``BatchSampler`` as sampler), and the one-process memmap gather of the same random
  rows as the limit.
- ``large``: the ``sample`` files with a per-process cache budget ``--cache-mib`` at
  least 4x smaller than the data, the same budget for every system that has one
  (evenly ``row_group_cache_bytes``, litdata ``max_cache_size``).

Every row: samples/s median [min-max], ratios (to litdata of the same workload, to
map-style for in-memory rows, to the memmap gather for columnar rows), peak PSS of the
process tree (total, non-reclaimable ``Pss_Anon + Pss_Shmem`` and file-backed
``Pss_File``), MB read by the workers in the timed epoch, missing/repeated ids and the
same-shard neighbour rate of the epoch's order (1/shards for a perfect shuffle).  evenly
over Parquet runs with its node decoded-row cache (the default; emptied before each run,
so the warm-up epoch decodes) and, as ``-process-cache``, with it off.

    bash bench/setup_peers.sh                 # peers; those not installed are skipped
    python bench/bench_formats.py             # the full run (~15 min on 2 cores)
    python bench/bench_formats.py --quick     # smoke run: small data, 1 round (~1 min)
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (
    Row,
    child_report,
    env_for,
    import_streaming,
    importable,
    print_goals,
    print_table,
    run_child,
    worker_read_chars,
)

PAYLOAD = 1024
MAP, MAP_TF, LIT = "sample:map-style-in-memory", "sample:map-style-transform", "sample:litdata"
GATHER, NP_BATCHED = "columnar:memmap-gather-1proc", "columnar:map-style-numpy-batched"
#: ratio references: label -> row key
R_MAP, R_MAP_TF, R_LIT = ("map", MAP), ("map+tf", MAP_TF), ("litdata", LIT)
R_COLUMNAR = (("litdata", "columnar:litdata"), ("np-batch", NP_BATCHED), ("gather", GATHER))
R_COLUMNAR_W0 = (R_COLUMNAR[0], ("np-batch-w0", NP_BATCHED + "-w0"), R_COLUMNAR[2])
#: (workload, contender, ratio references, the module it needs or "")
CONTENDERS: list[tuple[str, str, tuple[tuple[str, str], ...], str]] = [
    ("sample", "map-style-in-memory", (R_LIT,), ""),
    ("sample", "evenly-in-memory", (R_MAP, R_LIT), ""),
    ("sample", "evenly-in-memory-threads", (R_MAP, R_LIT), ""),
    ("sample", "map-style-transform", (), ""),
    ("sample", "evenly-transform-torch", (R_MAP_TF,), ""),
    ("sample", "evenly-transform-default", (R_MAP_TF,), ""),
    ("sample", "evenly-parquet", (R_LIT,), ""),
    ("sample", "evenly-parquet-process-cache", (R_LIT,), ""),
    ("sample", "evenly-parquet-block8", (R_LIT,), ""),
    ("sample", "evenly-tar", (R_LIT,), ""),
    ("sample", "evenly-tar-block8", (R_LIT,), ""),
    ("sample", "evenly-arrow", (R_LIT,), ""),
    ("sample", "litdata", (R_MAP,), "litdata"),
    ("sample", "hf-datasets", (R_LIT,), "datasets"),
    ("sample", "webdataset", (R_LIT,), "webdataset"),
    ("sample", "mosaic-streaming", (R_LIT,), "streaming"),
    ("columnar", "memmap-gather-1proc", (), ""),
    ("columnar", "map-style-numpy-batched", (("gather", GATHER),), ""),
    ("columnar", "evenly-arrow-columnar", R_COLUMNAR, ""),
    ("columnar", "evenly-arrow-procs", R_COLUMNAR, ""),
    ("columnar", "evenly-arrow-copy", R_COLUMNAR, ""),
    ("columnar", "evenly-parquet-columnar", R_COLUMNAR, ""),
    ("columnar", "evenly-parquet-procs", R_COLUMNAR, ""),
    ("columnar", "map-style-numpy-batched-w0", (("gather", GATHER),), ""),
    ("columnar", "evenly-arrow-columnar-w0", R_COLUMNAR_W0, ""),
    ("columnar", "litdata", (("gather", GATHER),), "litdata"),
    ("large", "evenly-parquet", (("litdata", "large:litdata"),), ""),
    ("large", "evenly-parquet-process-cache", (("litdata", "large:litdata"),), ""),
    ("large", "evenly-parquet-block8", (("litdata", "large:litdata"),), ""),
    ("large", "evenly-arrow", (("litdata", "large:litdata"),), ""),
    ("large", "litdata", (), "litdata"),
]
ALL = [f"{w}:{n}" for w, n, _, _ in CONTENDERS]
NOTES = {
    "sample:evenly-parquet": "node decoded-row cache (default)",
    "sample:evenly-parquet-process-cache": "decoded_cache_bytes=0: per-process LRU",
    "large:evenly-parquet": "node decoded-row cache (disk-backed, default bound)",
    "large:evenly-parquet-process-cache": "decoded_cache_bytes=0: per-process LRU",
    "large:litdata": "no decode cache for local chunks (max_cache_size bounds downloads)",
    "large:evenly-arrow": "memory-mapped: no per-process cache",
    "columnar:memmap-gather-1proc": "one process, no DataLoader",
    "columnar:map-style-numpy-batched-w0": "0 workers: no hand-off between processes",
    "columnar:evenly-arrow-columnar-w0": "0 workers: no hand-off between processes",
    "columnar:evenly-arrow-columnar": "worker_type='auto': 2 reader threads",
    "columnar:evenly-parquet-columnar": "worker_type='auto': 2 reader threads",
    "columnar:evenly-arrow-procs": "2 worker processes, zero-copy slots",
    "columnar:evenly-parquet-procs": "2 worker processes, zero-copy slots",
    "columnar:evenly-arrow-copy": "2 worker processes, slots copied out",
    "sample:evenly-in-memory-threads": "worker_type='thread': per-sample Python holds the GIL",
    "sample:hf-datasets": "shard shuffle + 10k buffer",
    "sample:webdataset": "shard shuffle + 10k buffer",
}


# ---- data ------------------------------------------------------------------------
def payloads(data_dir: str) -> np.ndarray:
    return np.memmap(os.path.join(data_dir, "payload.bin"), dtype=np.uint8, mode="r")


def rows2d(data_dir: str) -> np.ndarray:
    buf = payloads(data_dir)
    return buf.reshape(len(buf) // PAYLOAD, PAYLOAD)


def sample(buf: np.ndarray, i: int) -> dict[str, Any]:
    return {"id": i, "payload": bytes(buf[i * PAYLOAD : (i + 1) * PAYLOAD])}


def _litdata_item(i: int) -> dict[str, Any]:
    return sample(payloads(os.environ["EVENLY_BENCH_DATA"]), i)


def _litdata_col_item(i: int) -> dict[str, Any]:
    return {"idx": i, "data": np.array(rows2d(os.environ["EVENLY_BENCH_DATA"])[i])}


def _rows(data_dir: str) -> Iterator[dict[str, Any]]:
    buf = payloads(data_dir)
    return (sample(buf, i) for i in range(len(buf) // PAYLOAD))


def _col_rows(data_dir: str) -> Iterator[dict[str, Any]]:
    return ({"idx": i, "data": r} for i, r in enumerate(rows2d(data_dir)))


def prepare(data_dir: str, n: int, shards: int, names: list[str]) -> None:
    """Write each format the chosen contenders need, once (a ``.done`` file marks it)."""
    os.makedirs(data_dir, exist_ok=True)
    os.environ["EVENLY_BENCH_DATA"] = data_dir
    path = os.path.join(data_dir, "payload.bin")
    if not os.path.exists(path) or os.path.getsize(path) != n * PAYLOAD:
        np.random.default_rng(0).integers(0, 256, n * PAYLOAD, dtype=np.uint8).tofile(path)
    per = -(-n // shards)
    import pyarrow as pa

    import evenly

    col_schema = pa.schema([("idx", pa.int64()), ("data", pa.list_(pa.uint8(), PAYLOAD))])

    def ev(fmt: str, columnar: bool = False) -> Callable[[str], None]:
        def make(out: str) -> None:
            rows = _col_rows(data_dir) if columnar else _rows(data_dir)
            schema = col_schema if columnar else None
            evenly.write(rows, out, fmt, per, schema=schema, progress=False)

        return make

    def lit(fn: Callable[[int], Any]) -> Callable[[str], None]:
        def make(out: str) -> None:
            import litdata

            litdata.optimize(
                fn=fn,
                inputs=list(range(n)),
                output_dir=out,
                chunk_size=per,
                num_workers=1,
                mode="overwrite",
            )

        return make

    def mds(out: str) -> None:
        import_streaming()
        from streaming import MDSWriter

        columns = {"id": "int", "payload": "bytes"}
        with MDSWriter(out=out, columns=columns, size_limit=per * (PAYLOAD + 64)) as w:
            for s in _rows(data_dir):
                w.write(s)

    jobs: list[tuple[str, Callable[[str], None], tuple[str, ...]]] = [
        (
            "parquet",
            ev("parquet"),
            (
                "sample:evenly-parquet",
                "sample:evenly-parquet-block8",
                "large:evenly-parquet",
                "large:evenly-parquet-block8",
                "sample:evenly-parquet-process-cache",
                "large:evenly-parquet-process-cache",
                "sample:hf-datasets",
            ),
        ),
        (
            "tar",
            ev("webdataset"),
            ("sample:evenly-tar", "sample:evenly-tar-block8", "sample:webdataset"),
        ),
        ("arrow", ev("arrow"), ("sample:evenly-arrow", "large:evenly-arrow")),
        (
            "arrow-col",
            ev("arrow", True),
            ("columnar:evenly-arrow-columnar", "columnar:evenly-arrow-procs"),
        ),
        (
            "parquet-col",
            ev("parquet", True),
            ("columnar:evenly-parquet-columnar", "columnar:evenly-parquet-procs"),
        ),
        ("litdata", lit(_litdata_item), ("sample:litdata", "large:litdata")),
        ("litdata-col", lit(_litdata_col_item), ("columnar:litdata",)),
        ("mds", mds, ("sample:mosaic-streaming",)),
    ]
    for sub, make, users in jobs:
        out = os.path.join(data_dir, sub)
        if set(users) & set(names) and not os.path.exists(os.path.join(out, ".done")):
            print(f"preparing {sub} ...", file=sys.stderr)
            make(out)
            open(os.path.join(out, ".done"), "w").close()


# ---- what every system does per sample (in the child) ---------------------------------
def collate(batch: list[dict[str, Any]]) -> dict[str, Any]:
    """The shared per-sample decode: payload bytes -> one uint8 [B, 1024] tensor."""
    import torch

    ids = torch.tensor([int(s["id"]) for s in batch], dtype=torch.int64)
    data = bytearray(b"".join(bytes(s["payload"]) for s in batch))
    return {"id": ids, "data": torch.frombuffer(data, dtype=torch.uint8).view(len(batch), -1)}


def decode(s: dict[str, Any]) -> dict[str, Any]:
    """The per-sample transform: decode, and a random flip drawn from torch's generator."""
    import torch

    data = torch.frombuffer(bytearray(s["payload"]), dtype=torch.uint8)
    if float(torch.rand(())) < 0.5:
        data = data.flip(0)
    return {"id": s["id"], "data": data}


class _Items:
    """A map-style dataset doing the transform's work in ``__getitem__``."""

    def __init__(self, items: list[dict[str, Any]]) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return decode(self.items[i])


class _NumpyRows:
    """Map-style over a numpy memmap, indexed a whole batch at a time."""

    def __init__(self, data_dir: str) -> None:
        self.data_dir = data_dir
        self.n = len(payloads(data_dir)) // PAYLOAD
        self._rows: np.ndarray | None = None  # mapped on first use, in the worker

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, indices: list[int]) -> dict[str, np.ndarray]:
        if self._rows is None:
            self._rows = rows2d(self.data_dir)
        idx = np.asarray(indices, dtype=np.int64)
        return {"idx": idx, "data": self._rows[idx]}


def _memmap_gather(data_dir: str, batch: int) -> Iterable[Any]:
    class Epochs:
        epoch = 0

        def __iter__(self) -> Iterator[dict[str, Any]]:
            import torch

            rows = rows2d(data_dir)
            perm = np.random.default_rng(self.epoch).permutation(len(rows))
            self.epoch += 1
            for lo in range(0, perm.size, batch):
                p = perm[lo : lo + batch]
                yield {"idx": torch.from_numpy(p), "data": torch.from_numpy(rows[p])}

    return Epochs()


def loader_for(key: str, args: argparse.Namespace) -> Iterable[Any]:
    import torch.utils.data as tud

    workload, name = key.split(":")
    d, workers, batch = args.data_dir, args.workers, args.batch_size
    if name.endswith("-w0"):  # the same loader read in the main process
        name, workers = name[: -len("-w0")], 0
    #: evenly's reader and hand-off: -threads, -procs (zero-copy slots), -copy
    how = {
        "-threads": {"worker_type": "thread"},
        "-procs": {"worker_type": "process"},
        "-copy": {"worker_type": "process", "transport": "copy"},
    }
    chosen = next((k for k in how if name.startswith("evenly-") and name.endswith(k)), None)
    reader_kw: dict[str, Any] = how[chosen] if chosen else {}
    if chosen:
        name = name[: -len(chosen)]
    common: dict[str, Any] = {"batch_size": batch, "num_workers": workers}
    common["persistent_workers"] = workers > 0

    def files(sub: str, ext: str) -> list[str]:
        return sorted(glob.glob(os.path.join(d, sub, "*" + ext)))

    cache = args.cache_mib << 20 if workload == "large" else None
    if name.startswith("evenly-"):
        import evenly

        mode = "block" if name.endswith("block8") else "global"
        transform, gens = None, None
        fn: Callable[[list[dict[str, Any]]], Any] | None = collate
        if "in-memory" in name or "transform" in name:
            buf = payloads(d)
            src: Any = [sample(buf, i) for i in range(len(buf) // PAYLOAD)]
            if "transform" in name:
                transform, gens, fn = decode, ("torch",) if name.endswith("torch") else None, None
        elif workload == "columnar":
            fn = None
            sub = "arrow-col" if "arrow" in name else "parquet-col"
            reader = evenly.from_arrow if "arrow" in name else evenly.from_parquet
            src = reader(os.path.join(d, sub), cache_dir=os.path.join(d, "evenly-cache"))
        elif "parquet" in name:
            extra: dict[str, Any] = {} if cache is None else {"row_group_cache_bytes": cache}
            if name.endswith("process-cache"):
                extra["decoded_cache_bytes"] = 0
            rows_cache = os.path.join(d, "evenly-cache")
            shutil.rmtree(os.path.join(rows_cache, "rows"), ignore_errors=True)  # a fresh node
            src = evenly.from_parquet(os.path.join(d, "parquet"), cache_dir=rows_cache, **extra)
        elif "arrow" in name:
            src = evenly.from_arrow(os.path.join(d, "arrow"))
        else:
            src = evenly.from_webdataset(os.path.join(d, "tar"))
        kw: dict[str, Any] = {} if gens is None else {"seed_generators": gens}
        ds = evenly.Dataset(src, shuffle=mode, block_shards=8, transform=transform, **kw)
        columnar = True if workload == "columnar" else None
        return evenly.DataLoader(ds, collate_fn=fn, columnar=columnar, **common, **reader_kw)
    if name == "map-style-in-memory":
        buf = payloads(d)
        items = [sample(buf, i) for i in range(len(buf) // PAYLOAD)]
        return tud.DataLoader(items, shuffle=True, collate_fn=collate, **common)  # type: ignore[arg-type]
    if name == "map-style-transform":
        buf = payloads(d)
        ds_items = _Items([sample(buf, i) for i in range(len(buf) // PAYLOAD)])
        return tud.DataLoader(ds_items, shuffle=True, **common)  # type: ignore[arg-type]
    if name == "map-style-numpy-batched":
        rows = _NumpyRows(d)
        sampler = tud.BatchSampler(tud.RandomSampler(range(len(rows))), batch, drop_last=False)
        return tud.DataLoader(
            rows,
            batch_size=None,
            sampler=sampler,
            num_workers=workers,  # type: ignore[arg-type]
            persistent_workers=workers > 0,
        )
    if name == "memmap-gather-1proc":
        return _memmap_gather(d, batch)
    if name == "hf-datasets":
        import datasets

        hf = datasets.load_dataset(
            "parquet", data_files=files("parquet", ".parquet"), split="train", streaming=True
        )
        hf = hf.shuffle(seed=0, buffer_size=10_000)
        return tud.DataLoader(hf, collate_fn=collate, **common)
    if name == "webdataset":
        import webdataset as wds

        urls = files("tar", ".tar")
        w = wds.WebDataset(urls, shardshuffle=len(urls), nodesplitter=wds.single_node_only)
        return tud.DataLoader(w.shuffle(10_000), collate_fn=collate, **common)
    if name == "litdata":
        import litdata

        sub = "litdata-col" if workload == "columnar" else "litdata"
        extra = {} if cache is None else {"max_cache_size": cache}
        lit = litdata.StreamingDataset(os.path.join(d, sub), shuffle=True, seed=0, **extra)
        fn_lit = None if workload == "columnar" else collate
        loader: Iterable[Any] = litdata.StreamingDataLoader(lit, collate_fn=fn_lit, **common)
        return loader
    if name == "mosaic-streaming":
        streaming = import_streaming()
        from streaming.base.util import clean_stale_shared_memory

        clean_stale_shared_memory()
        mds = streaming.StreamingDataset(
            local=os.path.join(d, "mds"), shuffle=True, shuffle_seed=0, batch_size=batch
        )
        return tud.DataLoader(mds, collate_fn=collate, **common)
    raise ValueError(f"unknown contender {key!r}; choose from {ALL}")


def child(key: str, args: argparse.Namespace) -> None:
    """Iterate ``--warmup`` epochs, time the next one, report it (JSON on stdout)."""
    loader = loader_for(key, args)
    field = "idx" if key.startswith("columnar:") else "id"
    n = len(payloads(args.data_dir)) // PAYLOAD
    for _ in range(args.warmup):
        for _b in loader:
            pass
    read0 = {own: worker_read_chars(own) for own in (False, True)}
    ids: list[np.ndarray] = []
    t0 = time.perf_counter()
    for b in loader:
        ids.append(np.asarray(b[field]))
    seconds = time.perf_counter() - t0
    in_workers = args.workers > 0 and not key.endswith(("1proc", "-w0"))
    # reader threads read in this process
    threads = getattr(getattr(loader, "_engine", None), "_thread_views", None) is not None
    read = worker_read_chars(threads) - read0[threads] if in_workers else None
    child_report(ids, seconds, n, -(-n // args.shards), read)


# ---- parent ----------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--samples", type=int, default=200_000)
    ap.add_argument("--shards", type=int, default=64)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1, help="untimed epochs before the timed one")
    ap.add_argument("--cache-mib", type=int, default=40, help="per-process cache, large workload")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per run")
    ap.add_argument(
        "--max-minutes", type=float, default=18, help="stop adding rounds past this (wall)"
    )
    ap.add_argument("--prepare-only", action="store_true", help="write the data and exit")
    ap.add_argument("--data-dir", default=os.path.join("/tmp", "evenly-bench"))
    ap.add_argument("--only", default="", help="comma-separated workload:contender (or workload)")
    ap.add_argument("--quick", action="store_true", help="10,000 samples, 1 round, no warm-up")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args)
        return
    if args.quick:
        args.samples, args.rounds, args.warmup = 10_000, 1, 0
        args.cache_mib = max(1, min(args.cache_mib, args.samples * PAYLOAD // (5 << 20)))
    if args.cache_mib << 20 > args.samples * PAYLOAD // 4:
        ap.error(f"--cache-mib {args.cache_mib}: the large workload needs data >= 4x the cache")
    args.data_dir = os.path.join(args.data_dir, f"n{args.samples}-s{args.shards}")
    wanted = [x for x in args.only.split(",") if x]
    keys = [k for k in ALL if not wanted or k in wanted or k.split(":")[0] in wanted]
    if wanted and not keys:
        ap.error(f"--only matches no contender; choose from {ALL}")
    needs = {f"{w}:{n}": m for w, n, _, m in CONTENDERS}
    skipped = [k for k in keys if needs[k] and not importable(needs[k])]
    keys = [k for k in keys if k not in skipped]
    t_prep = time.perf_counter()
    prepare(args.data_dir, args.samples, args.shards, keys)
    if args.prepare_only:
        print(f"data ready in {time.perf_counter() - t_prep:.0f} s: {args.data_dir}")
        return
    print(
        f"# bench_formats: {args.samples:,} x {PAYLOAD} B in {args.shards} shards, "
        f"{args.workers} workers, batch {args.batch_size}, epoch {args.warmup + 1} timed, "
        f"{args.rounds} interleaved round(s); large workload cache {args.cache_mib} MiB per "
        f"process (data {args.samples * PAYLOAD / 2**20:,.0f} MiB); "
        f"data ready in {time.perf_counter() - t_prep:.0f} s"
    )
    refs = {f"{w}:{n}": r for w, n, r, _ in CONTENDERS}
    rows = {
        k: Row(k.split(":")[1], k.split(":")[0], refs=refs[k], note=NOTES.get(k, "")) for k in keys
    }
    base = [
        sys.executable,
        os.path.abspath(__file__),
        "--data-dir",
        args.data_dir,
        "--workers",
        str(args.workers),
        "--batch-size",
        str(args.batch_size),
        "--warmup",
        str(args.warmup),
        "--shards",
        str(args.shards),
        "--cache-mib",
        str(args.cache_mib),
    ]
    t0 = time.perf_counter()
    done = 0
    for r in range(args.rounds):
        elapsed = time.perf_counter() - t0
        if r and elapsed / r * (r + 1) > args.max_minutes * 60 - (t0 - t_prep):
            print(f"# stopped after {r} round(s): another would pass --max-minutes")
            break
        shift = r * len(keys) // max(args.rounds, 1)
        for k in keys[shift:] + keys[:shift]:
            t_run = time.perf_counter()
            res = run_child([*base, "--child", k], env_for(args.data_dir), args.timeout)
            rows[k].runs.append(res)
            rate = f"{res['samples'] / res['seconds']:,.0f}/s" if "error" not in res else "failed"
            wall = time.perf_counter() - t_run
            print(f"  round {r + 1} {k}: {rate} ({wall:.0f} s)", file=sys.stderr)
        done = r + 1
    print(f"# {done} round(s) in {time.perf_counter() - t0:.0f} s")
    titles = {
        "sample": "per-sample workload (same collate: bytes -> uint8[B,1024])",
        "columnar": "columnar workload (batches of idx int64[B], data uint8[B,1024])",
        "large": f"large workload: the sample files, cache budget {args.cache_mib} MiB/process",
    }
    by_name = {k: rows[k] for k in keys}
    for workload, title in titles.items():
        chosen = [rows[k] for k in keys if k.startswith(workload + ":")]
        if chosen:
            print_table(title, chosen, by_name)
    for k in skipped:
        print(f"{k:<30} skipped: {needs[k]} is not installed (bash bench/setup_peers.sh)")
    print_goals(GOALS, by_name)


#: The issue's goals: (what, ">=" or "<=", goal, row, reference row, figure compared)
GOALS: list[tuple[str, str, float, str, str, str]] = [
    ("in-memory vs map-style (2 workers)", ">=", 1.0, "sample:evenly-in-memory", MAP, "rate"),
    ("Parquet global (node cache) vs litdata", ">=", 2.0, "sample:evenly-parquet", LIT, "rate"),
    ("tar global vs litdata", ">=", 2.0, "sample:evenly-tar", LIT, "rate"),
    (
        "columnar Arrow global vs litdata",
        ">=",
        3.0,
        "columnar:evenly-arrow-columnar",
        "columnar:litdata",
        "rate",
    ),
    (
        "columnar Parquet global vs litdata",
        ">=",
        3.0,
        "columnar:evenly-parquet-columnar",
        "columnar:litdata",
        "rate",
    ),
    (
        "columnar Arrow vs map-style numpy batched",
        ">=",
        10.0,
        "columnar:evenly-arrow-columnar",
        NP_BATCHED,
        "rate",
    ),
    (
        "columnar Arrow, processes, vs map-style numpy batched (reported)",
        ">=",
        10.0,
        "columnar:evenly-arrow-procs",
        NP_BATCHED,
        "rate",
    ),
    (
        "columnar Parquet vs map-style numpy batched",
        ">=",
        1.0,
        "columnar:evenly-parquet-columnar",
        NP_BATCHED,
        "rate",
    ),
    (
        "columnar Arrow (threads) vs 1-process memmap gather",
        ">=",
        0.5,
        "columnar:evenly-arrow-columnar",
        GATHER,
        "rate",
    ),
    (
        "columnar Arrow, processes, vs memmap gather (reported)",
        ">=",
        0.5,
        "columnar:evenly-arrow-procs",
        GATHER,
        "rate",
    ),
    (
        "columnar Parquet (threads) vs 1-process memmap gather",
        ">=",
        0.5,
        "columnar:evenly-parquet-columnar",
        GATHER,
        "rate",
    ),
    (
        "transform, seed_generators=('torch',), vs map-style",
        ">=",
        0.8,
        "sample:evenly-transform-torch",
        MAP_TF,
        "rate",
    ),
    (
        "transform, default generators, vs map-style",
        ">=",
        1.0,
        "sample:evenly-transform-default",
        MAP_TF,
        "rate",
    ),
    (
        "peak PSS anon+shm, Parquet global vs litdata",
        "<=",
        1.0,
        "sample:evenly-parquet",
        LIT,
        "peak_anon",
    ),
    (
        "peak PSS anon+shm, large Parquet global vs litdata",
        "<=",
        1.0,
        "large:evenly-parquet",
        "large:litdata",
        "peak_anon",
    ),
    (
        "peak PSS file-backed, Parquet global vs litdata (reported)",
        "<=",
        1.0,
        "sample:evenly-parquet",
        LIT,
        "peak_file",
    ),
]


if __name__ == "__main__":
    main()
