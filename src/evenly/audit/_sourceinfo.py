"""What the audit records about an ``evenly.Dataset``'s source besides the samples: the
``evenly.Mix`` it reads (with the weight changes the audit makes, ``set_weights=``) and
its packing (``pack=``), for the findings that judge mixtures and packed rows.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from evenly.dataset import Dataset as EvenlyDataset
from evenly.dataset import planner_of
from evenly.mixture import Mix
from evenly.runtime.packer import PackedRows
from evenly.runtime.token_mix import TokenMixRows, token_reweighted

from ._types import AuditError, MixInfo, PackInfo, Settings

__all__ = ["mix_info", "pack_info", "reweigh"]


def mix_info(dataset: Any, settings: Settings) -> MixInfo | None:
    """The mixture an ``evenly.Dataset`` over an ``evenly.Mix`` read, else ``None``."""
    if not isinstance(dataset, EvenlyDataset) or not isinstance(dataset.source, Mix):
        return None
    if planner_of(dataset).strategy.packing is not None:  # by tokens: judged by pack_info
        return None
    mix = dataset.source
    offsets = tuple(tuple(mix.stream_offsets(e).values()) for e in range(settings.epochs))
    step = settings.world_size * settings.batch_size
    changes = tuple(
        (e, b * step, tuple(float(dict(w).get(n, 0.0)) for n in mix.names))
        for e, b, w in sorted(settings.set_weights)
    )
    bounds = tuple(mix.bounds(step).values())
    return MixInfo(mix.names, mix.lengths, tuple(mix.counts.values()), offsets, changes, bounds)


def reweigh(loader: Any, settings: Settings, epoch: int, batch: int) -> None:
    """``loader.set_weights(...)`` where ``settings.set_weights`` asks for it."""
    weights = settings.weights_after(epoch, batch)
    if weights is None:
        return
    setter = getattr(loader, "set_weights", None)
    if not callable(setter):
        raise AuditError(
            f"set_weights= asks for new weights after batch {batch} of epoch {epoch}, but "
            f"the loader, a {type(loader).__name__}, has no set_weights (an evenly.DataLoader "
            f"over an evenly.Mix has)"
        )
    setter(weights)


def pack_info(dataset: Any, epochs: int, settings: Settings | None = None) -> PackInfo | None:
    """The packing of a packed ``evenly.Dataset``, else ``None`` (for a Mix by tokens,
    each epoch's planned pieces, after the weight changes ``settings.set_weights`` asks)."""
    if not isinstance(dataset, EvenlyDataset):
        return None
    planner = planner_of(dataset)
    packer = planner.strategy
    if not isinstance(packer, PackedRows):
        return None
    files = packer.files(planner.view)
    rows = tuple(planner.units(e) for e in range(epochs))
    lengths = np.array(files.lengths, dtype=np.int64)
    if not isinstance(packer, TokenMixRows):
        return PackInfo(packer.packing.seq_len, planner.pad, lengths, rows)
    shuffle = planner.shuffle_mode != "none"
    changes = sorted(settings.set_weights) if settings is not None else []
    step = settings.world_size * settings.batch_size if settings is not None else 1
    expected, part = [], None
    for e in range(epochs):
        for _, b, w in (c for c in changes if c[0] == e):  # as the loader applies them
            part = token_reweighted(
                dataset.source,
                packer.packing,
                files.lengths,
                part,
                epoch=e,
                position=b * step,
                weights=dict(w),
                seed=planner.seed,
                shuffle=shuffle,
            )
        items = packer.items(planner.view, planner.seed, e, shuffle, part).items
        expected.append(
            tuple(np.asarray(items[k], dtype=np.int64) for k in ("doc", "start", "len"))
        )
    return PackInfo(packer.packing.seq_len, planner.pad, lengths, rows, tuple(expected))  # type: ignore[arg-type]
