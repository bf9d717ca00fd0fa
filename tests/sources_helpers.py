"""Helpers shared by the file-format source tests: epochs over simulated ranks and the
exactly-once check."""

from __future__ import annotations

from collections import Counter
from typing import Any

import evenly


def as_list(batch: list[Any]) -> list[Any]:
    """A collate_fn that keeps samples as they are (picklable for spawn)."""
    return batch


def epoch_over_ranks(
    source: Any,
    *,
    world_size: int,
    batch_size: int,
    num_workers: int,
    shuffle: bool | str = True,
    block_shards: int = 8,
    epochs: int = 1,
    seed: int = 0,
) -> list[list[list[list[Any]]]]:
    """``[epoch][rank] -> list of batches`` with ranks simulated by explicit args."""
    out: list[list[list[list[Any]]]] = [[] for _ in range(epochs)]
    for rank in range(world_size):
        ds: evenly.Dataset[Any] = evenly.Dataset(
            source,
            shuffle=shuffle,
            block_shards=block_shards,
            seed=seed,
            rank=rank,
            world_size=world_size,
        )
        if shuffle == "block" or (shuffle is True and source.preferred_shuffle == "block"):
            plan = ds.plan()  # the block shuffle is in use, with this window
            window = getattr(plan, "block_shards", None) or getattr(plan.order, "window", None)
            assert window == block_shards, (window, block_shards)
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
