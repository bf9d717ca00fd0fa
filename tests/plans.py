"""Plans for tests, with the shuffle named as the datasets name it (``shuffle=True`` is the
global shuffle; ``shard_sizes`` + ``block_shards`` the block shuffle)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from evenly.core import EpochPlan
from evenly.core.order import make_order


def make_plan(
    *,
    num_samples: int,
    shuffle: bool = False,
    shard_sizes: Sequence[int] | None = None,
    block_shards: int = 0,
    seed: int = 0,
    epoch: int = 0,
    **kwargs: Any,
) -> EpochPlan:
    mode = "block" if block_shards else ("global" if shuffle else "none")
    order = make_order(
        mode,
        num_samples,
        seed=seed,
        epoch=epoch,
        shard_sizes=shard_sizes,
        block_shards=block_shards,
    )
    return EpochPlan(num_samples=num_samples, seed=seed, epoch=epoch, order=order, **kwargs)
