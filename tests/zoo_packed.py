"""Packed datasets for the audit: right ones, and ones with one defect each.

Documents hold tokens that name them (document ``i``'s token ``t`` is ``1000 * (i + 1) + t``;
pad_id 0 is never used).  Factories are module-level: the audit's spawned ranks import
them.

- ``packed(strategy)``: right (``concat`` or ``best_fit``).
- ``one_rank_share``: every rank reads rank 0's share (``rank=0, world_size=2`` fixed on
  each rank): rank 1's tokens never come, rank 0's come twice.
- ``mixed``: right, an ``evenly.Mix(unit="tokens")``; ``mixed_one_rank_share``: the same
  with rank 0's share on every rank.
- ``forgets_position``: its own ``evenly.DataLoader`` whose state says the epoch had not
  started (the epoch restarts after a resume: tokens repeated).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

import evenly
from evenly.audit import LoaderFactory

SEQ = 16
LENGTHS = [int(n) for n in np.random.default_rng(7).integers(1, 40, size=61)]  # some > SEQ


def docs() -> list[list[int]]:
    return [[1000 * (i + 1) + t for t in range(n)] for i, n in enumerate(LENGTHS)]


def packed(strategy: str = "concat", **kwargs: Any) -> evenly.Dataset[Any]:
    pack = evenly.Packing(SEQ, strategy=strategy)
    return evenly.Dataset(docs(), shuffle=True, seed=3, pack=pack, **kwargs)


def one_rank_share() -> tuple[evenly.Dataset[Any], dict[str, Any]]:
    return packed(rank=0, world_size=2), {"agreement_timeout": None}


class ForgetfulLoader(evenly.DataLoader):
    """An ``evenly.DataLoader`` whose saved state forgets the position in the epoch."""

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        return {**state, "position": 0, "batches": 0}


def _forgetful(dataset: evenly.Dataset[Any], **kwargs: Any) -> ForgetfulLoader:
    return ForgetfulLoader(dataset, **kwargs)


def forgets_position() -> LoaderFactory:
    dataset = packed()
    return LoaderFactory(make=functools.partial(_forgetful, dataset), dataset=dataset)


def mixed(**kwargs: Any) -> evenly.Dataset[Any]:
    """Right: a Mix by tokens (source ``b``, a third of the tokens, is up-sampled: some of
    its documents come twice in an epoch, as planned)."""
    mix = evenly.Mix(
        {"a": docs(), "b": docs()[:20]},
        weights={"a": 1, "b": 1},
        unit="tokens",
        tokens_per_epoch=sum(LENGTHS),
    )
    return evenly.Dataset(mix, shuffle=True, seed=3, pack=evenly.Packing(SEQ), **kwargs)


def mixed_one_rank_share() -> tuple[evenly.Dataset[Any], dict[str, Any]]:
    return mixed(rank=0, world_size=2), {"agreement_timeout": None}
