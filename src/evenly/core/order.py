"""Choosing an epoch's order: the identity, the global keyed permutation or the block
shuffle.  The plan takes the order it is given (``EpochPlan(order=...)``); this module is
the one place that builds one from a shuffle mode.

Pure numpy: no torch, no I/O.

>>> order = make_order("global", 10, seed=0, epoch=1)
>>> sorted(order(range(10)).tolist()) == list(range(10))
True
>>> make_order("none", 10, seed=0, epoch=1) is None
True
"""

from __future__ import annotations

from collections.abc import Sequence

from evenly.core.block import BlockPermutation
from evenly.core.permutation import FeistelPermutation
from evenly.core.plan import Order
from evenly.options import SHUFFLE_MODES

__all__ = ["SHUFFLE_MODES", "make_order"]


def make_order(
    mode: str,
    num_samples: int,
    *,
    seed: int,
    epoch: int,
    shard_sizes: Sequence[int] | None = None,
    block_shards: int = 8,
) -> Order | None:
    """The order of epoch ``epoch`` for shuffle ``mode`` (``None`` for ``"none"``)."""
    if mode == "none":
        return None
    if mode == "global":
        return FeistelPermutation(num_samples, seed=seed, epoch=epoch)
    if mode == "block":
        sizes = tuple(shard_sizes or ())
        if sum(sizes) != num_samples:
            raise ValueError(
                f"a block shuffle needs shard sizes that add up to num_samples={num_samples}, "
                f"got {sum(sizes)}"
            )
        return BlockPermutation(sizes, block_shards, seed=seed, epoch=epoch)
    raise ValueError(f"shuffle mode must be one of {SHUFFLE_MODES}, got {mode!r}")
