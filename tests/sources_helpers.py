"""Helpers shared by the file-format source tests: epochs over simulated ranks, the
exactly-once check, and the block-shuffle bridge until ``Dataset`` takes ``block_shards``."""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import evenly


def as_list(batch: list[Any]) -> list[Any]:
    """A collate_fn that keeps samples as they are (picklable for spawn)."""
    return batch


class BlockDataset(evenly.Dataset):  # type: ignore[type-arg]
    """``evenly.Dataset`` with the block shuffle (the lead's ``shuffle="block"`` API will
    replace this): the plan gets the source's shard sizes and ``block_shards``."""

    def __init__(self, source: Any, *, block_shards: int, **kwargs: Any) -> None:
        super().__init__(source, shuffle=True, **kwargs)
        self.block_shards = block_shards

    def plan(self) -> evenly.EpochPlan:
        return dataclasses.replace(
            super().plan(),
            shard_sizes=tuple(self.source.shard_sizes),
            block_shards=self.block_shards,
        )


def epoch_over_ranks(
    source: Any,
    *,
    world_size: int,
    batch_size: int,
    num_workers: int,
    block_shards: int = 0,
    epochs: int = 1,
    seed: int = 0,
) -> list[list[list[list[Any]]]]:
    """``[epoch][rank] -> list of batches`` with ranks simulated by explicit args."""
    out: list[list[list[list[Any]]]] = [[] for _ in range(epochs)]
    for rank in range(world_size):
        if block_shards:
            ds: evenly.Dataset[Any] = BlockDataset(
                source, block_shards=block_shards, seed=seed, rank=rank, world_size=world_size
            )
        else:
            ds = evenly.Dataset(source, shuffle=True, seed=seed, rank=rank, world_size=world_size)
        loader = evenly.DataLoader(
            ds,
            batch_size=batch_size,
            num_workers=num_workers,
            collate_fn=as_list,
            timeout=60 if num_workers else 0,  # a hang in a worker fails the test instead
        )
        for e in range(epochs):
            out[e].append([list(b) for b in loader])
    return out


def check_exactly_once(ranks: list[list[list[Any]]], expected_ids: list[Any], key: Any) -> None:
    """Every id once across ranks, every rank the same number of batches and samples."""
    counts = {len(batches) for batches in ranks}
    assert len(counts) == 1, f"ranks yield different batch counts: {counts}"
    sizes = {sum(len(b) for b in batches) for batches in ranks}
    assert len(sizes) == 1, f"ranks yield different sample counts: {sizes}"
    seen = Counter(key(s) for batches in ranks for b in batches for s in b)
    assert seen == Counter(expected_ids)
