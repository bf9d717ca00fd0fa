"""The talk's successive attempts at an iterable dataset, as factories for ``evenly audit``.

Each factory is called once in every rank process (torch.distributed is initialised
there) and returns that rank's dataset, or ``(dataset, dataloader_kwargs)`` when the
attempt needs something from the DataLoader (a ``worker_init_fn``, a sampler).  Every
sample is its own integer id, ``0 <= id < size``; ids live in "class folders" of
``FOLDER`` consecutive ids (``folder_of`` is the shard function to pass as --shard-fn).

Run one from the repository root::

    evenly audit examples.talk_attempts:naive --workers 2 --world-size 2 --epochs 2
    python -m evenly.audit examples.talk_attempts:shard_then_shuffle \\
        --shard-fn examples.talk_attempts:folder_of

The broken attempts, in the talk's order:

1. ``naive``: a generator over all samples; every worker of every rank yields all of it.
2. ``shard_by_worker``: split by ``get_worker_info()``; right for workers, but every rank
   still yields everything, and each worker batches its own leftovers.
3. ``shard_then_shuffle``: contiguous blocks ("files") per (rank, worker), shuffled inside
   the worker: exactly once, but a batch only ever mixes one folder.
4. ``shuffle_then_shard``: shuffle everything, then take every G-th sample; each worker
   shuffles with its own seed, so the shards overlap.
5. ``fixed_seed``: (4) with ``random.seed(0)`` etc. in ``worker_init_fn``: exactly once,
   but every worker draws the same augmentations and every epoch has the same order.

And the ones that work: ``evenly_dataset``, ``distributed_sampler`` (map-style), and,
when installed, ``hf_iterable`` (HF datasets) and ``webdataset_pipeline``.
"""

from __future__ import annotations

import io
import os
import random
import tarfile
import tempfile
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import Dataset, DistributedSampler, IterableDataset, get_worker_info

import evenly

#: Samples per dataset, unless a factory is given ``size=``.
SIZE = 200
#: Consecutive ids per "class folder".
FOLDER = 50


def folder_of(sample_id: int) -> int:
    """The shard/group of a sample: its class folder (use as ``--shard-fn``)."""
    return int(sample_id) // FOLDER


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _worker() -> tuple[int, int]:
    info = get_worker_info()
    return (0, 1) if info is None else (info.id, info.num_workers)


class NaiveIterable(IterableDataset[int]):
    """Attempt 1, the talk's ``MyIterableDS``: ``yield from range(size)``."""

    def __init__(self, size: int = SIZE) -> None:
        self.size = size

    def __iter__(self) -> Iterator[int]:
        yield from range(self.size)

    def __len__(self) -> int:
        return self.size


class ShardByWorker(NaiveIterable):
    """Attempt 2: each worker takes every ``num_workers``-th sample; ranks are ignored."""

    def __iter__(self) -> Iterator[int]:
        worker, workers = _worker()
        yield from range(worker, self.size, workers)


class ShardThenShuffle(NaiveIterable):
    """Attempt 3: each (rank, worker) reads its own contiguous block and shuffles it."""

    def __iter__(self) -> Iterator[int]:
        rank, world = _rank_world()
        worker, workers = _worker()
        g, total = rank * workers + worker, world * workers
        block = list(range(g * self.size // total, (g + 1) * self.size // total))
        random.shuffle(block)
        yield from block

    def __len__(self) -> int:
        return self.size // _rank_world()[1]


class ShuffleThenShard(NaiveIterable):
    """Attempt 4: shuffle all ids with the worker's own seed, then take every G-th."""

    def __iter__(self) -> Iterator[int]:
        rank, world = _rank_world()
        worker, workers = _worker()
        order = list(range(self.size))
        random.shuffle(order)
        yield from order[rank * workers + worker :: world * workers]

    def __len__(self) -> int:
        return self.size // _rank_world()[1]


def _same_seed(worker_id: int) -> None:
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


class MapStyle(Dataset[int]):
    """The talk's ``MyMapStyleDS``: sample ``i`` is ``i``."""

    def __init__(self, size: int = SIZE) -> None:
        self.size = size

    def __getitem__(self, index: int) -> int:
        return index

    def __len__(self) -> int:
        return self.size


def naive(size: int = SIZE) -> NaiveIterable:
    return NaiveIterable(size)


def shard_by_worker(size: int = SIZE) -> ShardByWorker:
    return ShardByWorker(size)


def shard_then_shuffle(size: int = SIZE) -> ShardThenShuffle:
    return ShardThenShuffle(size)


def shuffle_then_shard(size: int = SIZE) -> ShuffleThenShard:
    return ShuffleThenShard(size)


def fixed_seed(size: int = SIZE) -> tuple[ShuffleThenShard, dict[str, Any]]:
    return ShuffleThenShard(size), {"worker_init_fn": _same_seed}


def evenly_dataset(size: int = SIZE) -> evenly.Dataset[int]:
    return evenly.Dataset(list(range(size)), shuffle=True, seed=0)


def distributed_sampler(size: int = SIZE) -> tuple[MapStyle, dict[str, Any]]:
    dataset = MapStyle(size)
    return dataset, {"sampler": DistributedSampler(dataset, shuffle=True, seed=0)}


def hf_iterable(size: int = SIZE) -> Any:
    """HF datasets: an IterableDataset in 8 shards, buffer-shuffled, split by node."""
    from datasets import Dataset as HFDataset  # type: ignore[import-untyped]
    from datasets.distributed import split_dataset_by_node  # type: ignore[import-untyped]

    rank, world = _rank_world()
    ds = HFDataset.from_dict({"idx": list(range(size))}).to_iterable_dataset(num_shards=8)
    ds = ds.shuffle(seed=0, buffer_size=FOLDER)
    return split_dataset_by_node(ds, rank=rank, world_size=world)


def _write_shards(size: int, num_shards: int) -> list[str]:
    """Write ``num_shards`` tar files of consecutive ids once (atomically, any rank)."""
    folder = os.path.join(tempfile.gettempdir(), f"evenly-audit-wds-{size}-{num_shards}")
    os.makedirs(folder, exist_ok=True)
    paths = []
    for s in range(num_shards):
        path = os.path.join(folder, f"shard-{s:04d}.tar")
        paths.append(path)
        if os.path.exists(path):
            continue
        tmp = f"{path}.{os.getpid()}.tmp"
        with tarfile.open(tmp, "w") as tar:
            for i in range(s * size // num_shards, (s + 1) * size // num_shards):
                data = str(i).encode()
                member = tarfile.TarInfo(f"{i:06d}.idx")
                member.size = len(data)
                tar.addfile(member, io.BytesIO(data))
        os.replace(tmp, path)
    return paths


def _decode(sample: dict[str, Any]) -> dict[str, Any]:
    return {"__key__": sample["__key__"], "idx": int(sample["idx"])}


def webdataset_pipeline(size: int = SIZE) -> Any:
    """WebDataset: 8 tar shards, shard shuffle, split by node and worker, buffer shuffle."""
    import webdataset as wds  # type: ignore[import-untyped]

    urls = _write_shards(size, 8)
    return (
        wds.WebDataset(
            urls,
            shardshuffle=8,
            nodesplitter=wds.split_by_node,
            workersplitter=wds.split_by_worker,
        )
        .shuffle(FOLDER)
        .map(_decode)
    )
