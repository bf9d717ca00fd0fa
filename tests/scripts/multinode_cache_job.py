"""One rank of a simulated two-node job over files, started by tests/test_multinode_cache.py:
two torchrun agents with the c10d rendezvous on 127.0.0.1 (``--nnodes 2``, 2 ranks each),
one of them in its own UTS and mount namespace (another host name, a private /dev/shm).

Each rank reads, through ``evenly.DataLoader(num_workers=2)``, four loaders in turn:
a Parquet source with a global shuffle and a packed dataset (``evenly.Packing`` over
pre-tokenized Parquet), each once with the ``cache_dir`` both nodes share and once with
this node's private one.  It writes what it received to ``<out>/<name>-rank<RANK>.json``
(ids per batch for Parquet, each row's non-pad tokens for packing) and appends one line
per node-shared file it writes (a decoded row group, a lengths file, an epoch's packing
plan) to ``<out>/writes.log``: the test counts how often each was written over the nodes.

    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d \
        --rdzv-endpoint 127.0.0.1:P tests/scripts/multinode_cache_job.py \
        --out DIR --parquet DIR --tokens DIR --shared DIR --private DIR
"""

from __future__ import annotations

import argparse
import json
import os
import socket
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import evenly
import evenly.runtime.lengths as lengths_mod
import evenly.runtime.packed_plans as plans_mod
import evenly.sources._rowcache as rowcache_mod

LOG: Path | None = None


def record_writes() -> None:
    """Count each node-shared file this process writes (one line in the log, O_APPEND)."""

    def logged(kind: str, name: str) -> None:
        assert LOG is not None
        line = f"{kind} {socket.gethostname()} {os.environ['GROUP_RANK']} {name}\n"
        fd = os.open(LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)

    write_rows, read_lengths = rowcache_mod._write, lengths_mod._read_lengths
    concat = plans_mod.concat_checkpoints

    def rows(tmp: str, *args: Any, **kwargs: Any) -> Any:
        entry = os.path.basename(tmp).partition(".part-")[0]
        logged("rows", f"{os.path.dirname(os.path.dirname(tmp))}:{entry}")
        return write_rows(tmp, *args, **kwargs)

    def lengths(*args: Any, **kwargs: Any) -> Any:
        logged("lengths", os.environ["EVENLY_CACHE_DIR"])
        return read_lengths(*args, **kwargs)

    def plan(*args: Any, **kwargs: Any) -> Any:
        logged("plan", os.environ["EVENLY_CACHE_DIR"])
        return concat(*args, **kwargs)

    rowcache_mod._write = rows  # type: ignore[assignment]
    lengths_mod._read_lengths = lengths  # type: ignore[assignment]
    plans_mod.concat_checkpoints = plan  # type: ignore[assignment]


def read_parquet(data: Path, cache_dir: str, seed: int, batch: int) -> dict[str, Any]:
    source = evenly.from_parquet(str(data), cache_dir=cache_dir)
    ds: evenly.Dataset[Any] = evenly.Dataset(source, shuffle=True, seed=seed)
    loader = evenly.DataLoader(ds, batch_size=batch, num_workers=2, timeout=120)
    batches = []
    for b in loader:
        batches.append(b["id"].tolist())
        dist.all_reduce(torch.ones(1))  # as DDP's backward would
    return {"batches": batches, "num_batches": loader.plan.num_batches}


def read_packed(data: Path, seed: int, batch: int, seq_len: int) -> dict[str, Any]:
    pack = evenly.Packing(seq_len, document_ids=True)
    ds: evenly.Dataset[Any] = evenly.Dataset(
        evenly.from_parquet(str(data)), shuffle=True, seed=seed, pack=pack
    )
    loader = evenly.DataLoader(ds, batch_size=batch, num_workers=2, timeout=120)
    rows = []
    for b in loader:
        for ids, docs in zip(b["input_ids"].tolist(), b["document_ids"].tolist(), strict=True):
            rows.append([t for t, d in zip(ids, docs, strict=True) if d])
        dist.all_reduce(torch.ones(1))
    return {"rows": rows, "num_batches": loader.plan.num_batches}


def main() -> None:
    global LOG
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--parquet", type=Path, required=True)
    parser.add_argument("--tokens", type=Path, required=True)
    parser.add_argument("--shared", required=True, help="the cache_dir both nodes share")
    parser.add_argument("--private", required=True, help="this node's own cache_dir")
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=32)
    args = parser.parse_args()

    rank = int(os.environ["RANK"])
    (args.out / f"rank{rank}.pid").write_text(str(os.getpid()))
    LOG = args.out / "writes.log"
    record_writes()
    dist.init_process_group("gloo")

    record: dict[str, Any] = {
        "rank": rank,
        "world_size": dist.get_world_size(),
        "node": int(os.environ["GROUP_RANK"]),
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "host": socket.gethostname(),
        "shm": os.stat("/dev/shm").st_dev,
    }
    for name, cache_dir in (("shared", args.shared), ("private", args.private)):
        os.environ["EVENLY_CACHE_DIR"] = cache_dir  # packing's lengths and plans
        record[f"parquet-{name}"] = read_parquet(
            args.parquet, cache_dir, args.seed, args.batch_size
        )
        record[f"packed-{name}"] = read_packed(
            args.tokens, args.seed, args.batch_size, args.seq_len
        )
        dist.barrier()
    tmp = args.out / f"rank{rank}.json.tmp"
    tmp.write_text(json.dumps(record))
    os.replace(tmp, args.out / f"rank{rank}.json")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
