"""evenly vs its peers on object storage: one S3 server on 127.0.0.1 behind a throttling proxy.

Set-up (issue 28): the script starts moto's S3 server (``ThreadedMotoServer``, in a
subprocess of its own, bound to 127.0.0.1, gone when this script exits) and, per link
profile, a proxy in front of it that delays every request and caps the bandwidth
(``tests/s3proxy.py``).  It writes the dataset once per system in that system's own format
(``--samples`` rows of ``{"label": i, "payload": --sample-bytes random bytes}`` in
``--shards`` shards: Parquet and WebDataset tar for evenly, litdata chunks, MosaicML MDS),
uploads each to its own prefix, and runs every contender in a fresh subprocess per round,
the order rotated every round.  Each contender: one process, ``--workers`` (2) loader
workers, batch ``--batch-size`` (64), shuffle on, a fresh cache directory:

- ``cold``: the first epoch, from building the dataset (listing, index downloads) to its
  last batch; ``first``: from building the dataset to the first batch (the system's own
  import included; torch, which every system imports, is imported before the clock starts);
- ``warm``: a second epoch in the same process (the cache as the first epoch left it);
- ``fetched``: bytes the proxy sent during the cold epoch (and during the warm one), as a
  multiple of that system's objects on the server;
- ``cache``: the system's cache directory on disk after the cold epoch (``du``: allocated
  blocks);
- ``PSS``: peak PSS of the process tree (non-reclaimable anonymous + shared memory, and
  file-backed), sampled by the parent;
- ``once``: the labels seen in each epoch are every label exactly once (``0/0`` missing/
  repeated), or the epoch was cut at ``--epoch-limit`` seconds (then: no repeats; its
  rate is over the samples it read, its bytes fetched scaled to a whole epoch);
- ``flight``: the most requests in flight at once at the proxy during the run.

Contenders: ``evenly-parquet`` and ``evenly-tar`` (``shuffle=True``: the block shuffle,
evenly's remote default), ``evenly-tar-global`` (``shuffle="global"`` with the bounded
cache: no dataset-sized cache), each with evenly's default client for ``s3://``;
``evenly-parquet-s3fs`` / ``-obstore`` and ``evenly-tar-global-s3fs`` / ``-obstore``:
the same with ``$EVENLY_OBSTORE=0`` (fsspec/s3fs) / ``=1`` (obstore, where installed; an
``@LABEL`` row of them reads with whatever that source has), litdata
``StreamingDataset`` over ``s3://`` with boto3 (``litdata``) and with obstore
(``litdata-obstore``, where obstore is installed: litdata uses it by itself then),
MosaicML ``StreamingDataset(remote="s3://...")``, HF datasets streaming Parquet through
fsspec (``storage_options``); ``-bounded`` variants run the cold epoch with a cache of
``--bounded-mib`` (default: two shuffle windows, 16 shards' bytes: 256 MiB at the
default size) for the bytes-fetched row. Three reference rows: ``raw-gets`` (every Parquet
object fetched once through the same proxy with N requests in flight, nothing decoded,
best N of ``--raw-n``: what this machine can move through the proxy), ``raw-ranges``
(``--raw-ranges`` samples in a random order, one range GET each, best N: the most samples
per second a global shuffle by range can get from this server) and ``link-limit``
(dataset bytes / bandwidth).

    bash bench/setup_peers.sh                   # peers, obstore, moto[server], s3fs
    python bench/bench_remote.py                # the full run: both profiles, 2 rounds
    python bench/bench_remote.py --samples 4000 --profile 20ms,100MB/s --rounds 1 --epoch-limit 60

A profile is ``DELAY,BANDWIDTH[,PER_CONNECTION]`` (``80ms,30MB/s``; MB = 10^6 bytes).
``--json PATH`` writes every run's figures.  ``--also-src LABEL=PATH`` adds the evenly
contenders imported from ``PATH`` (another commit's ``src``) as ``NAME@LABEL``, in the
same rounds.  Every evenly tree a child imports is a compiled copy (bytecode written, as
``pip install`` does), like the peers' installed packages.  Pass ``--child`` /
``--serve-s3`` only internally.
"""

from __future__ import annotations

import argparse
import compileall
import concurrent.futures
import contextlib
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import child_mark, env_for, import_streaming, importable, run_child, summary

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUCKET = "bench"
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}
LIT, RAW, LINK = "litdata", "raw-gets", "link-limit"
RAW_RANGES = "raw-ranges"


@dataclass(frozen=True)
class Contender:
    """One row: the system, the format it reads, what it needs installed, its cache."""

    name: str
    fmt: str  # prefix of its objects on the server
    needs: str = ""
    bounded: bool = False  # cache of --bounded-mib, cold epoch only
    note: str = ""


CONTENDERS = [
    Contender("evenly-parquet", "parquet", note="from_parquet, shuffle=True (block)"),
    Contender("evenly-tar", "tar", note="from_webdataset, shuffle=True (block)"),
    Contender("evenly-tar-global", "tar", bounded=True, note='shuffle="global", bounded cache'),
    Contender("evenly-parquet-s3fs", "parquet", note="evenly-parquet, $EVENLY_OBSTORE=0"),
    Contender("evenly-parquet-obstore", "parquet", "obstore", note="$EVENLY_OBSTORE=1"),
    Contender("evenly-tar-global-s3fs", "tar", bounded=True, note="$EVENLY_OBSTORE=0"),
    Contender("evenly-tar-global-obstore", "tar", "obstore", bounded=True, note="=1"),
    Contender(LIT, "litdata", "litdata", note="boto3 (obstore off)"),
    Contender("litdata-obstore", "litdata", "obstore", note="obstore (allow_http for 127.0.0.1)"),
    Contender("mosaic-streaming", "mds", "streaming", note="remote=s3://"),
    Contender("hf-datasets", "parquet", "datasets", note="streaming, fsspec, buffer 1000"),
    Contender("evenly-parquet-bounded", "parquet", bounded=True),
    Contender("evenly-tar-bounded", "tar", bounded=True),
    Contender("litdata-bounded", "litdata", "litdata", bounded=True, note="max_cache_size"),
    Contender("mosaic-streaming-bounded", "mds", "streaming", bounded=True, note="cache_limit"),
    Contender(RAW, "parquet", note="every object once, N in flight, no decode"),
    Contender(RAW_RANGES, "tar", note="one range GET per sample, random order, N in flight"),
]
BY_NAME = {c.name: c for c in CONTENDERS}
EVENLY = [c.name for c in CONTENDERS if c.name.startswith("evenly-")]


# ---- link profiles ----------------------------------------------------------------------
@dataclass(frozen=True)
class Profile:
    delay: float  # seconds per request
    bandwidth: float  # bytes/s, all connections together
    per_connection: float | None  # bytes/s per connection

    @property
    def label(self) -> str:
        per = f", {self.per_connection / 1e6:g} MB/s per connection" if self.per_connection else ""
        return f"{self.delay * 1e3:g} ms, {self.bandwidth / 1e6:g} MB/s{per}"


def _rate(text: str) -> float:
    t = text.strip().lower().removesuffix("/s")
    for unit, mult in (("gb", 1e9), ("mb", 1e6), ("kb", 1e3), ("b", 1.0)):
        if t.endswith(unit):
            return float(t[: -len(unit)]) * mult
    return float(t)


def parse_profile(text: str) -> Profile:
    """``"20ms,100MB/s"`` or ``"80ms,30MB/s,10MB/s"`` (the last: per connection)."""
    parts = [p.strip() for p in text.split(",")]
    if len(parts) not in (2, 3) or not parts[0].endswith("ms"):
        raise argparse.ArgumentTypeError(
            f"profile {text!r}: expected DELAYms,BANDWIDTH[,PER_CONNECTION], e.g. 20ms,100MB/s"
        )
    try:
        per = _rate(parts[2]) if len(parts) == 3 else None
        return Profile(float(parts[0][:-2]) / 1e3, _rate(parts[1]), per)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"profile {text!r}: {exc}") from None


# ---- the server and the proxy (parent) ---------------------------------------------------
def serve_s3() -> None:
    """``--serve-s3``: moto's server on 127.0.0.1 until stdin closes (the parent exits)."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    print(f"http://{host}:{port}", flush=True)
    try:
        sys.stdin.read()
    finally:
        server.stop()


@contextlib.contextmanager
def s3_server() -> Iterator[str]:
    """Start the server subprocess; its endpoint URL.  It stops when this script exits,
    however it exits (its stdin closes)."""
    env = {**os.environ, **CREDENTIALS, "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, os.path.abspath(__file__), "--serve-s3"]
    proc = subprocess.Popen(
        cmd,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,  # its request log
        env=env,
        text=True,
    )
    try:
        url = proc.stdout.readline().strip() if proc.stdout else ""
        if not url.startswith("http://127.0.0.1:"):
            raise RuntimeError(f"moto's server did not start (said {url!r})")
        yield url
    finally:
        if proc.stdin:
            proc.stdin.close()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def storage_options(endpoint: str) -> dict[str, Any]:
    """s3fs options for the server (or the proxy) at ``endpoint``."""
    return {
        "key": CREDENTIALS["AWS_ACCESS_KEY_ID"],
        "secret": CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        "client_kwargs": {"endpoint_url": endpoint},
        "skip_instance_cache": True,
    }


def proxy_class() -> Any:
    """``tests/s3proxy.py``'s ``S3Proxy`` (the repository's test helper), or None."""
    sys.path.insert(0, ROOT)
    try:
        from tests.s3proxy import S3Proxy
    except ImportError:
        return None
    finally:
        sys.path.remove(ROOT)
    return S3Proxy


class Link:
    """The throttling proxy of one profile in front of the server, with its counters."""

    def __init__(self, upstream: str, profile: Profile) -> None:
        self.profile = profile
        self._proxy = proxy_class()(
            upstream,
            delay=profile.delay,
            bandwidth=profile.bandwidth,
            per_connection_bandwidth=profile.per_connection,
        )
        self._proxy.__enter__()
        self.url: str = self._proxy.url

    def counts(self) -> dict[str, int]:
        """``requests``, ``bytes`` (response bodies sent) and ``max_concurrent`` since
        the last reset."""
        s = self._proxy.stats()
        return {k: int(s[k]) for k in ("requests", "bytes", "max_concurrent")}

    def reset(self) -> None:
        self._proxy.reset_stats()

    def close(self) -> None:
        self._proxy.__exit__(None, None, None)


# ---- the data (parent) ---------------------------------------------------------------------
def payloads(data_dir: str, size: int) -> np.ndarray:
    buf = np.memmap(os.path.join(data_dir, "payload.bin"), dtype=np.uint8, mode="r")
    return buf.reshape(-1, size)


def _rows(data_dir: str, size: int) -> Iterator[dict[str, Any]]:
    rows = payloads(data_dir, size)
    return ({"label": i, "payload": bytes(r)} for i, r in enumerate(rows))


def _litdata_item(i: int) -> dict[str, Any]:
    size = int(os.environ["EVENLY_BENCH_SAMPLE_BYTES"])
    rows = payloads(os.environ["EVENLY_BENCH_DATA"], size)
    return {"label": i, "payload": bytes(rows[i])}


def prepare(data_dir: str, n: int, size: int, shards: int, formats: set[str]) -> None:
    """Write each format the chosen contenders read, once (a ``.done`` file marks it)."""
    os.makedirs(data_dir, exist_ok=True)
    os.environ["EVENLY_BENCH_DATA"] = data_dir
    os.environ["EVENLY_BENCH_SAMPLE_BYTES"] = str(size)
    path = os.path.join(data_dir, "payload.bin")
    if not os.path.exists(path) or os.path.getsize(path) != n * size:
        rng = np.random.default_rng(0)
        with open(path, "wb") as f:
            for lo in range(0, n, 1024):
                f.write(rng.integers(0, 256, min(1024, n - lo) * size, dtype=np.uint8).tobytes())
    per = -(-n // shards)

    def ev(fmt: str) -> Callable[[str], None]:
        def make(out: str) -> None:
            import evenly

            evenly.write(_rows(data_dir, size), out, fmt, per, progress=False)

        return make

    def lit(out: str) -> None:
        import litdata

        litdata.optimize(
            fn=_litdata_item,
            inputs=list(range(n)),
            output_dir=out,
            chunk_size=per,
            num_workers=1,
            mode="overwrite",
        )

    def mds(out: str) -> None:
        import_streaming()
        from streaming import MDSWriter

        columns = {"label": "int", "payload": "bytes"}
        with MDSWriter(out=out, columns=columns, size_limit=per * (size + 64)) as w:
            for s in _rows(data_dir, size):
                w.write(s)

    makers = {"parquet": ev("parquet"), "tar": ev("webdataset"), "litdata": lit, "mds": mds}
    for fmt in sorted(formats):
        out = os.path.join(data_dir, fmt)
        if not os.path.exists(os.path.join(out, ".done")):
            print(f"preparing {fmt} ...", file=sys.stderr)
            shutil.rmtree(out, ignore_errors=True)
            makers[fmt](out)
            open(os.path.join(out, ".done"), "w").close()


def upload(endpoint: str, data_dir: str, formats: set[str]) -> dict[str, int]:
    """Copy each format's files (hidden ones included, ``.done`` not) to
    ``s3://bench/<format>/``, straight to the server; the bytes of each."""
    import s3fs

    fs = s3fs.S3FileSystem(**storage_options(endpoint))
    fs.mkdir(BUCKET)
    sizes: dict[str, int] = {}
    for fmt in sorted(formats):
        local = os.path.join(data_dir, fmt)
        total = 0
        for dirpath, _, names in os.walk(local):
            for name in sorted(names):
                if name == ".done":
                    continue
                path = os.path.join(dirpath, name)
                rel = os.path.relpath(path, local)
                fs.put_file(path, f"{BUCKET}/{fmt}/{rel}")
                total += os.path.getsize(path)
        sizes[fmt] = total
    return sizes


# ---- the child: one contender, one process ----------------------------------------------------
def collate(batch: list[dict[str, Any]]) -> dict[str, Any]:
    """The same per-batch work for every system: labels -> int64[B], payloads -> uint8[B, S]."""
    import torch

    labels = torch.tensor([int(s["label"]) for s in batch], dtype=torch.int64)
    data = bytearray(b"".join(bytes(s["payload"]) for s in batch))
    return {"label": labels, "data": torch.frombuffer(data, dtype=torch.uint8).view(len(batch), -1)}


def du(path: str) -> int:
    """Bytes allocated on disk under ``path`` (what ``du`` counts)."""
    total = 0
    for dirpath, _, names in os.walk(path):
        for name in names:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
    return total


def loader_for(name: str, a: argparse.Namespace, cache: str) -> tuple[Iterable[Any], Any]:
    """The contender's loader over the proxy at ``a.endpoint``; and an ``on_epoch(e)`` hook
    for the systems whose documented epoch loop calls one (HF ``set_epoch``), else None."""
    import torch.utils.data as tud

    c = BY_NAME[name.partition("@")[0]]
    remote = f"s3://{BUCKET}/{c.fmt}"
    bound = a.bounded_mib << 20 if c.bounded else None
    common: dict[str, Any] = {"batch_size": a.batch_size, "num_workers": a.workers}
    common["persistent_workers"] = a.workers > 0
    if c.name.startswith("evenly-"):
        import evenly

        kw: dict[str, Any] = {"storage_options": storage_options(a.endpoint), "cache_dir": cache}
        if bound is not None:
            kw["cache_bytes"] = bound
        if c.fmt == "parquet":
            src: Any = evenly.from_parquet(remote, **kw)
        else:
            src = evenly.from_webdataset(remote, **kw)
        shuffle: Any = "global" if "-global" in c.name else True
        ds = evenly.Dataset(src, shuffle=shuffle)
        return evenly.DataLoader(ds, collate_fn=collate, **common), None
    if c.name.startswith("litdata"):
        import litdata
        import litdata.streaming.downloader as lit_dl

        if c.name in (LIT, "litdata-bounded"):  # boto3: litdata's path without obstore
            lit_dl._OBSTORE_AVAILABLE = False
        else:  # obstore refuses a plain-http endpoint unless told (https S3 needs nothing)
            opts = dict(lit_dl._OBSTORE_CLIENT_OPTIONS)
            lit_dl._OBSTORE_CLIENT_OPTIONS = {**opts, "allow_http": True}
        so = {
            "endpoint_url": a.endpoint,
            "aws_access_key_id": CREDENTIALS["AWS_ACCESS_KEY_ID"],
            "aws_secret_access_key": CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        }
        extra: dict[str, Any] = {} if bound is None else {"max_cache_size": bound}
        lit = litdata.StreamingDataset(
            remote, cache_dir=cache, shuffle=True, seed=0, storage_options=so, **extra
        )
        return litdata.StreamingDataLoader(lit, collate_fn=collate, **common), None
    if c.name.startswith("mosaic-streaming"):
        streaming = import_streaming()
        from streaming.base.util import clean_stale_shared_memory

        clean_stale_shared_memory()
        extra = {} if bound is None else {"cache_limit": bound}
        mds = streaming.StreamingDataset(
            remote=remote,
            local=cache,
            shuffle=True,
            shuffle_seed=0,
            batch_size=a.batch_size,
            **extra,
        )
        return tud.DataLoader(mds, collate_fn=collate, **common), None
    if c.name == "hf-datasets":
        import datasets

        hf = datasets.load_dataset(
            "parquet",
            data_files={"train": f"{remote}/*.parquet"},
            split="train",
            streaming=True,
            storage_options=storage_options(a.endpoint),
        )
        hf = hf.shuffle(seed=0, buffer_size=1000)
        return tud.DataLoader(hf, collate_fn=collate, **common), hf.set_epoch
    raise ValueError(f"unknown contender {name!r}; choose from {list(BY_NAME)}")


def child(name: str, a: argparse.Namespace) -> None:
    """Build the loader, run the cold epoch (and the warm one), print the figures (JSON)."""
    if name.partition("@")[0] == RAW:
        raw_child(a)
        return
    if name.partition("@")[0] == RAW_RANGES:
        raw_ranges_child(a)
        return
    cache = a.cache_dir
    out: dict[str, Any] = {}
    epochs = 1 if BY_NAME[name.partition("@")[0]].bounded else 2
    import torch.utils.data  # noqa: F401  # every system's: not part of building a dataset

    t0 = time.perf_counter()
    loader, on_epoch = loader_for(name, a, cache)
    for epoch in range(epochs):
        if on_epoch is not None:
            on_epoch(epoch)
        labels: list[np.ndarray] = []
        start = t0 if epoch == 0 else time.perf_counter()
        cut = False
        for b in loader:
            labels.append(np.asarray(b["label"]))
            if epoch == 0 and len(labels) == 1:
                out["first_s"] = time.perf_counter() - t0
            if time.perf_counter() - start > a.epoch_limit:
                cut = True
                break
        seconds = time.perf_counter() - start
        seen = np.concatenate(labels) if labels else np.zeros(0, np.int64)
        unique = np.unique(seen)
        tag = "cold" if epoch == 0 else "warm"
        out[tag] = {
            "samples": int(seen.size),
            "seconds": seconds,
            "missing": None if cut else int(a.samples - unique.size),
            "repeated": int(seen.size - unique.size),
            "cut": cut,
        }
        child_mark(tag)  # the parent reads the proxy's counters here
        out[tag]["cache_bytes"] = du(cache)
        if cut:
            break
    print(json.dumps(out))
    sys.stdout.flush()
    if not any(e.get("cut") for e in out.values() if isinstance(e, dict)):
        return  # a normal exit: every system cleans up (mosaic's shared memory)
    # workers of a cut epoch are mid-download, and prefetchers may run ahead: end them now
    # so that nothing of this run reaches the proxy during the next one
    import signal

    import psutil

    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # torch's handler would raise on the kills
    for p in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            p.kill()
    os._exit(0)


def raw_child(a: argparse.Namespace) -> None:
    """Every Parquet object fetched once through the proxy with N requests in flight,
    bodies read and dropped; the best N (and every N's time)."""
    import boto3
    from botocore.config import Config

    times: dict[int, float] = {}
    for n in a.raw_n:
        cfg = Config(max_pool_connections=n, retries={"max_attempts": 3})
        s3 = boto3.client("s3", endpoint_url=a.endpoint, config=cfg)
        t0 = time.perf_counter()
        keys = [
            o["Key"]
            for page in s3.get_paginator("list_objects_v2").paginate(
                Bucket=BUCKET, Prefix="parquet/"
            )
            for o in page.get("Contents", [])
            if o["Key"].endswith(".parquet")
        ]

        def get(key: str, s3: Any = s3) -> int:
            body = s3.get_object(Bucket=BUCKET, Key=key)["Body"]
            got = 0
            while chunk := body.read(1 << 20):
                got += len(chunk)
            return got

        with concurrent.futures.ThreadPoolExecutor(n) as pool:
            got = sum(pool.map(get, keys))
        times[n] = time.perf_counter() - t0
        child_mark(f"raw-{n}")
    best = min(times, key=lambda k: times[k])
    cold = {"samples": a.samples, "seconds": times[best], "missing": 0, "repeated": 0}
    print(
        json.dumps({"cold": {**cold, "cut": False}, "best_n": best, "times": times, "bytes": got})
    )


def sample_spans(tar_dir: str) -> list[tuple[str, int, int]]:
    """``(object key, start, end)`` of every sample's members in the tar shards (a
    sample's members are contiguous: one range covers them, as evenly's reader merges
    them into one request)."""
    import tarfile

    spans: list[tuple[str, int, int]] = []
    for name in sorted(n for n in os.listdir(tar_dir) if n.endswith(".tar")):
        by_key: dict[str, tuple[int, int]] = {}
        with tarfile.open(os.path.join(tar_dir, name)) as tf:
            for m in tf:
                if not m.isfile():
                    continue
                stem = m.name.split(".", 1)[0]
                lo, hi = by_key.get(stem, (m.offset_data, m.offset_data + m.size))
                by_key[stem] = (min(lo, m.offset_data), max(hi, m.offset_data + m.size))
        spans += [(f"tar/{name}", lo, hi) for lo, hi in by_key.values()]
    return spans


def raw_ranges_child(a: argparse.Namespace) -> None:
    """The server's ceiling for a global shuffle by range: ``--raw-ranges`` samples in a
    random order, each fetched by one range GET through the proxy with N requests in
    flight, bodies read and dropped; the best N (and every N's rate)."""
    import boto3
    from botocore.config import Config

    local = os.path.join(a.data_dir, f"n{a.samples}-b{a.sample_bytes}-s{a.shards}", "tar")
    spans = sample_spans(local)
    order = np.random.default_rng(0).permutation(len(spans))[: a.raw_ranges].tolist()
    times: dict[int, float] = {}
    got = 0
    for n in a.raw_n:
        cfg = Config(max_pool_connections=n, retries={"max_attempts": 3})
        s3 = boto3.client("s3", endpoint_url=a.endpoint, config=cfg)

        def get(i: int, s3: Any = s3) -> int:
            key, lo, hi = spans[i]
            body = s3.get_object(Bucket=BUCKET, Key=key, Range=f"bytes={lo}-{hi - 1}")["Body"]
            return len(body.read())

        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(n) as pool:
            got = sum(pool.map(get, order))
        times[n] = time.perf_counter() - t0
        child_mark(f"raw-{n}")
    best = min(times, key=lambda k: times[k])
    cold = {"samples": len(order), "seconds": times[best], "missing": 0, "repeated": 0}
    rates = {n: len(order) / t for n, t in times.items()}
    print(
        json.dumps({"cold": {**cold, "cut": False}, "best_n": best, "rates": rates, "bytes": got})
    )


# ---- the parent ---------------------------------------------------------------------------
@dataclass
class Row:
    """One contender's runs under one profile."""

    name: str
    runs: list[dict[str, Any]] = field(default_factory=list)

    @property
    def error(self) -> str | None:
        return next((r["error"] for r in self.runs if "error" in r), None)

    def ok(self) -> list[dict[str, Any]]:
        return [r for r in self.runs if "error" not in r]

    def med(self, fn: Callable[[dict[str, Any]], float | None]) -> float | None:
        values = [v for r in self.ok() if (v := fn(r)) is not None]
        return statistics.median(values) if values and self.error is None else None

    def span(self, fn: Callable[[dict[str, Any]], float | None]) -> tuple[float, float, float]:
        return summary([v for r in self.ok() if (v := fn(r)) is not None] or [0.0])

    def worst(self, key: str) -> Any:
        values = [r[key] for r in self.ok() if r.get(key) is not None]
        return max(values) if values else None


def rate(epoch: str) -> Callable[[dict[str, Any]], float | None]:
    def f(r: dict[str, Any]) -> float | None:
        e = r.get(epoch)
        return e["samples"] / e["seconds"] if e and e["seconds"] > 0 else None

    return f


def fetched(epoch: str) -> Callable[[dict[str, Any]], float | None]:
    """Bytes the proxy sent during the epoch, per epoch's worth of samples (an epoch cut
    at ``--epoch-limit`` is scaled up by the samples it did not read)."""

    def f(r: dict[str, Any]) -> float | None:
        got, e = (r.get("fetched") or {}).get(epoch), r.get(epoch)
        if got is None or not e or not e["samples"]:
            return None
        return float(got) * (r["n"] / e["samples"] if e["cut"] else 1.0)

    return f


def _x(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def once(r: Row) -> str:
    """Missing/repeated labels, worst over the rounds and epochs; "cut" if an epoch was."""
    worst_miss = worst_rep = 0
    cut = False
    for run in r.ok():
        for tag in ("cold", "warm"):
            e = run.get(tag)
            if not e:
                continue
            cut |= e["cut"]
            worst_miss = max(worst_miss, e["missing"] or 0)
            worst_rep = max(worst_rep, e["repeated"])
    ok = "ok" if not worst_miss and not worst_rep else "FAIL"
    return f"{worst_miss}/{worst_rep} {ok}{' (cut)' if cut else ''}"


def report(
    a: argparse.Namespace, profile: Profile, rows: dict[str, Row], sizes: dict[str, int]
) -> list[str]:
    """Print one profile's table and goals; the lines of the goals."""
    n, data = a.samples, a.samples * a.sample_bytes
    link_s = data / profile.bandwidth
    print(
        f"\n## profile {profile.label}: dataset {data / 1e6:,.0f} MB, link limit "
        f"{link_s:.1f} s = {n / link_s:,.0f} samples/s"
    )
    lit, raw = rows.get(LIT), rows.get(RAW)
    lit_cold = lit.med(rate("cold")) if lit else None
    raw_cold = raw.med(rate("cold")) if raw else None
    head = (
        f"{'contender':<28} {'cold samples/s [min-max]':>27} {'/lit':>6} {'/raw':>6} "
        f"{'warm samples/s':>14} {'/lit':>6} {'first s':>7} {'/lit':>6} {'fetched x':>10} "
        f"{'warm x':>7} {'flight':>6} {'cache MiB':>9} {'PSS anon/file':>14} "
        f"{'once (miss/rep)':<16}"
    )
    print(head)
    print("-" * len(head))
    for name, row in rows.items():
        c = BY_NAME[name.partition("@")[0]]
        if row.error is not None:
            print(f"{name:<28} failed: {row.error}")
            continue
        cold_med, lo, hi = row.span(rate("cold"))
        warm = row.med(rate("warm"))
        first = row.med(lambda r: r.get("first_s"))
        size = sizes.get(c.fmt, 0)
        fx = row.med(fetched("cold"))
        wx = row.med(fetched("warm"))
        disk = row.med(lambda r: r.get("cold", {}).get("cache_bytes"))
        flight = row.med(lambda r: (r.get("fetched") or {}).get("max_concurrent"))
        anon, file = row.worst("peak_anon"), row.worst("peak_file")
        extra = ""
        if name in (RAW, RAW_RANGES):
            best = [r.get("best_n") for r in row.ok()]
            extra = f"best N {best}"
        print(
            f"{name:<28} {cold_med:>10,.0f} [{lo:,.0f}-{hi:,.0f}]".ljust(57)
            + f"{_x(cold_med, lit_cold):>6} {_x(cold_med, raw_cold):>6} "
            + (f"{warm:>14,.0f} " if warm else f"{'-':>14} ")
            + f"{_x(warm, lit.med(rate('warm')) if lit else None):>6} "
            + (f"{first:>7.2f} " if first is not None else f"{'-':>7} ")
            + f"{_x(first, lit.med(lambda r: r.get('first_s')) if lit else None):>6} "
            + (f"{fx / size:>9.2f}x " if fx is not None and size else f"{'-':>10} ")
            + (f"{wx / size:>6.2f}x " if wx is not None and size else f"{'-':>7} ")
            + (f"{flight:>6.0f} " if flight is not None else f"{'-':>6} ")
            + (f"{disk / 2**20:>9,.0f} " if disk is not None else f"{'-':>9} ")
            + (f"{anon / 2**20:>6,.0f}/{file / 2**20:<7,.0f} " if anon else f"{'-':>14} ")
            + f"{once(row):<16} {c.note} {extra}".rstrip()
        )
    print(
        f"{LINK:<28} {n / link_s:>10,.0f}".ljust(57)
        + f"{_x(n / link_s, lit_cold):>6} {_x(n / link_s, raw_cold):>6}   dataset bytes / bandwidth"
    )
    return goals(rows, sizes, raw_cold, n / link_s)


def goals(
    rows: dict[str, Row], sizes: dict[str, int], raw_cold: float | None, link: float
) -> list[str]:
    """The issue's goals as ratios of this profile's medians (PSS: peak over the rounds)."""

    def med(name: str, fn: Callable[[dict[str, Any]], float | None]) -> float | None:
        r = rows.get(name)
        return r.med(fn) if r is not None else None

    def first(r: dict[str, Any]) -> float | None:
        return r.get("first_s")  # type: ignore[no-any-return]

    def disk(r: dict[str, Any]) -> float | None:
        return r.get("cold", {}).get("cache_bytes")  # type: ignore[no-any-return]

    def worst(name: str, key: str) -> float | None:
        r = rows.get(name)
        return r.worst(key) if r is not None else None

    def per_size(name: str, v: float | None) -> float | None:
        size = sizes.get(BY_NAME[name.partition("@")[0]].fmt)
        return v / size if v is not None and size else None

    lines: list[tuple[str, str, float, float | None]] = []
    for ev in ("evenly-parquet", "evenly-tar"):
        for ref in (LIT, "litdata-obstore"):
            cold, rcold = med(ev, rate("cold")), med(ref, rate("cold"))
            lines.append((f"cold epoch, {ev} / {ref}", ">=", 1.5, _div(cold, rcold)))
        lines.append((f"cold epoch, {ev} / raw parallel GETs", ">=", 0.85, _div(cold, raw_cold)))
        lines.append((f"cold epoch, {ev} / link limit (reported)", ">=", 0.85, _div(cold, link)))
        for ref in (LIT, "litdata-obstore"):
            lines.append(
                (
                    f"time to first batch, {ev} / {ref}",
                    "<=",
                    0.5,
                    _div(med(ev, first), med(ref, first)),
                )
            )
        lines.append(
            (f"cache on disk, {ev} / its objects' bytes", "<=", 1.05, per_size(ev, med(ev, disk)))
        )
        for ref in (LIT, "litdata-obstore"):
            lines.append(
                (
                    f"peak PSS anon+shm, {ev} / {ref}",
                    "<=",
                    1.0,
                    _div(worst(ev, "peak_anon"), worst(ref, "peak_anon")),
                )
            )
        lines.append(
            (
                f"bytes fetched, {ev}-bounded / its objects",
                "<=",
                1.05,
                per_size(ev, med(f"{ev}-bounded", fetched("cold"))),
            )
        )
    g = "evenly-tar-global"
    lines.append(
        (
            f"cold epoch, {g} / evenly-tar",
            ">=",
            0.5,
            _div(med(g, rate("cold")), med("evenly-tar", rate("cold"))),
        )
    )
    lines.append(
        (f"bytes fetched, {g} / its objects", "<=", 1.2, per_size(g, med(g, fetched("cold"))))
    )
    lines.append(
        (
            f"cold epoch, {g} / raw range GETs (reported)",
            ">=",
            0.85,
            _div(med(g, rate("cold")), med(RAW_RANGES, rate("cold"))),
        )
    )
    for base in ("evenly-parquet", "evenly-tar-global"):  # evenly's client for s3://
        on, off = med(f"{base}-obstore", rate("cold")), med(f"{base}-s3fs", rate("cold"))
        lines.append((f"cold epoch, {base} on obstore / on s3fs", ">=", 1.0, _div(on, off)))
    out = []
    print("\n## goals (ratios of this profile's medians; PSS: peak over the rounds)")
    for what, op, goal, value in lines:
        if value is None:
            continue
        met = value >= goal if op == ">=" else value <= goal
        text = f"{what:<58} {op} {goal:<5} {value:6.2f}x  {'met' if met else 'NOT met'}"
        print(text)
        out.append(text)
    if len(out) < len(lines):
        print(f"({len(lines) - len(out)} goal(s) not measured: their rows not run, or failed)")
    return out


def _div(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--samples", type=int, default=40_000)
    ap.add_argument("--sample-bytes", type=int, default=25 * 1024)
    ap.add_argument("--shards", type=int, default=64)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument(
        "--profile",
        type=parse_profile,
        action="append",
        help="DELAYms,BANDWIDTH[,PER_CONNECTION]; repeat for several (default: both below)",
    )
    ap.add_argument(
        "--bounded-mib", type=int, help="bounded cache (default: 2 windows = 16 shards' bytes)"
    )
    ap.add_argument("--raw-n", default="4,8,16,32", help="requests in flight tried for raw-gets")
    ap.add_argument(
        "--raw-ranges", type=int, default=2000, help="samples fetched by range for raw-ranges"
    )
    ap.add_argument("--epoch-limit", type=float, default=120, help="cut an epoch past this (s)")
    ap.add_argument("--timeout", type=float, default=1200, help="seconds per run")
    ap.add_argument("--max-minutes", type=float, default=150, help="stop adding rounds past this")
    ap.add_argument("--only", default="", help="comma-separated contenders")
    ap.add_argument(
        "--data-dir", default=os.path.join(tempfile.gettempdir(), "evenly-bench-remote")
    )
    ap.add_argument("--json", help="write every run's figures here")
    ap.add_argument("--also-src", nargs="*", default=[], metavar="LABEL=PATH")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--endpoint", help=argparse.SUPPRESS)
    ap.add_argument("--cache-dir", help=argparse.SUPPRESS)
    ap.add_argument("--serve-s3", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    a.raw_n = [int(x) for x in a.raw_n.split(",") if x]
    if a.bounded_mib is None:
        per_shard = -(-a.samples // a.shards) * a.sample_bytes
        a.bounded_mib = max(1, round(16 * per_shard / 2**20))
    if a.serve_s3:
        serve_s3()
        return
    if a.child:
        child(a.child, a)
        return
    profiles = a.profile or [parse_profile("20ms,100MB/s"), parse_profile("80ms,30MB/s")]
    if proxy_class() is None:
        ap.error(
            f"the throttling proxy {os.path.join(ROOT, 'tests', 's3proxy.py')} is missing or "
            "does not import: without it there is no delay, no bandwidth cap and no byte count"
        )
    wanted = [x for x in a.only.split(",") if x]
    unknown = [x for x in wanted if x not in BY_NAME]
    if unknown:
        ap.error(f"--only {unknown}: choose from {list(BY_NAME)}")
    names = [c.name for c in CONTENDERS if not wanted or c.name in wanted]
    skipped = {
        n: BY_NAME[n].needs for n in names if BY_NAME[n].needs and not importable(BY_NAME[n].needs)
    }
    names = [n for n in names if n not in skipped]
    sources = dict(item.split("=", 1) for item in a.also_src)
    names += [f"{n}@{label}" for label in sources for n in names if n in EVENLY]
    data_dir = os.path.join(a.data_dir, f"n{a.samples}-b{a.sample_bytes}-s{a.shards}")
    formats = {BY_NAME[n.partition("@")[0]].fmt for n in names}
    t_prep = time.perf_counter()
    prepare(data_dir, a.samples, a.sample_bytes, a.shards, formats)
    os.environ.update(CREDENTIALS)
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):
        os.environ.pop(var, None)
    results: dict[str, Any] = {"args": {k: v for k, v in vars(a).items() if k != "profile"}}
    with s3_server() as upstream:
        sizes = upload(upstream, data_dir, formats)
        print(
            f"# bench_remote: {a.samples:,} x {a.sample_bytes:,} B in {a.shards} shards "
            f"({a.samples * a.sample_bytes / 1e6:,.0f} MB), {a.workers} workers, batch "
            f"{a.batch_size}, bounded cache {a.bounded_mib} MiB, {a.rounds} interleaved round(s); "
            f"objects: "
            + ", ".join(f"{k} {v / 1e6:,.0f} MB" for k, v in sizes.items())
            + f"; data written and uploaded in {time.perf_counter() - t_prep:.0f} s"
        )
        links = [Link(upstream, p) for p in profiles]
        rows = [{n: Row(n) for n in names} for _ in profiles]
        scratch = tempfile.mkdtemp(prefix="bench-remote-cache-", dir=a.data_dir)
        compiled = compiled_sources(sources, scratch)
        t0 = time.perf_counter()
        done = 0
        try:
            for r in range(a.rounds):
                elapsed = time.perf_counter() - t0
                if r and elapsed / r * (r + 1) > a.max_minutes * 60:
                    print(f"# stopped after {r} round(s): another would pass --max-minutes")
                    break
                shift = r * len(names) // max(a.rounds, 1)
                for p, link in enumerate(links):
                    for name in names[shift:] + names[:shift]:
                        res = run_one(a, name, link, sizes, compiled, scratch)
                        rows[p][name].runs.append(res)
                done = r + 1
        finally:
            for link in links:
                link.close()
            shutil.rmtree(scratch, ignore_errors=True)
    print(f"# {done} round(s) in {time.perf_counter() - t0:.0f} s")
    results["profiles"] = []
    for profile, prow in zip(profiles, rows, strict=True):
        goal_lines = report(a, profile, prow, sizes)
        results["profiles"].append(
            {
                "profile": profile.label,
                "delay_s": profile.delay,
                "bandwidth": profile.bandwidth,
                "per_connection": profile.per_connection,
                "object_bytes": sizes,
                "rows": {k: v.runs for k, v in prow.items()},
                "goals": goal_lines,
            }
        )
    for n, mod in skipped.items():
        print(f"{n:<28} skipped: {mod} is not installed (bash bench/setup_peers.sh)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1, default=str)


def compiled_sources(sources: dict[str, str], scratch: str) -> dict[str, str]:
    """Each evenly tree the children import (``""``: the one this script imports, then
    every ``--also-src``), copied under ``scratch`` with its bytecode written, as ``pip
    install`` writes it: under ``$PYTHONDONTWRITEBYTECODE`` a source tree without
    ``__pycache__`` is compiled again in every child (about 0.15 s of the first batch on
    this machine), while the peers are installed packages, compiled once."""
    spec = importlib.util.find_spec("evenly")
    roots = dict(sources)
    if spec is not None and spec.submodule_search_locations:
        roots[""] = os.path.dirname(next(iter(spec.submodule_search_locations)))
    out: dict[str, str] = {}
    for label, root in roots.items():
        dst = os.path.join(scratch, f"src-{label or 'this'}")
        shutil.copytree(
            os.path.join(root, "evenly"),
            os.path.join(dst, "evenly"),
            ignore=shutil.ignore_patterns("__pycache__"),
        )
        compileall.compile_dir(dst, quiet=1)
        out[label] = dst
    return out


def run_one(
    a: argparse.Namespace,
    name: str,
    link: Link,
    sizes: dict[str, int],
    sources: dict[str, str],
    scratch: str,
) -> dict[str, Any]:
    """One contender in a fresh subprocess with a fresh cache dir; the proxy's counters
    read at each epoch's end."""
    cache = tempfile.mkdtemp(prefix=name.replace("@", "-") + "-", dir=scratch)
    env = {**env_for(a.data_dir), **CREDENTIALS, "S3_ENDPOINT_URL": link.url}
    env["HF_HOME"] = os.path.join(cache, "hf")  # HF datasets' cache counts as the system's
    env["EVENLY_CACHE_DIR"] = cache
    client = name.partition("@")[0].rsplit("-", 1)[-1]  # the client evenly reads s3:// with
    if client in ("s3fs", "obstore"):
        env["EVENLY_OBSTORE"] = "1" if client == "obstore" else "0"
    label = name.partition("@")[2]
    if label in sources:  # this tree's (label ""), compiled; or another commit's
        env["PYTHONPATH"] = os.pathsep.join(
            [sources[label], *([env["PYTHONPATH"]] if not label and env.get("PYTHONPATH") else [])]
        )
    cmd = [sys.executable, os.path.abspath(__file__), "--child", name, "--endpoint", link.url]
    cmd += ["--cache-dir", cache, "--samples", str(a.samples), "--workers", str(a.workers)]
    cmd += ["--batch-size", str(a.batch_size), "--bounded-mib", str(a.bounded_mib)]
    cmd += ["--epoch-limit", str(a.epoch_limit), "--raw-n", ",".join(map(str, a.raw_n))]
    cmd += ["--data-dir", a.data_dir, "--sample-bytes", str(a.sample_bytes)]
    cmd += ["--shards", str(a.shards), "--raw-ranges", str(a.raw_ranges)]
    counts: dict[str, Any] = {}
    last = {"requests": 0, "bytes": 0}

    def on_mark(tag: str) -> None:
        now = link.counts()
        counts[tag] = now["bytes"] - last["bytes"]
        counts[tag + "_requests"] = now["requests"] - last["requests"]
        counts["max_concurrent"] = now["max_concurrent"]
        last.update(now)

    link.reset()
    t = time.perf_counter()
    res = run_child(cmd, env, a.timeout, on_mark=on_mark)
    shutil.rmtree(cache, ignore_errors=True)
    res["fetched"] = counts
    res["n"] = a.samples
    res["wall_s"] = time.perf_counter() - t
    cold = res.get("cold")
    msg = res.get("error") or (f"cold {cold['samples'] / cold['seconds']:,.0f}/s" if cold else "?")
    print(f"  {link.profile.label} {name}: {msg} ({res['wall_s']:.0f} s)", file=sys.stderr)
    return res


if __name__ == "__main__":
    main()
