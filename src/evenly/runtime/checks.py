"""What a pass checks and says: the warnings about padding, idle workers and empty epochs
(in the main process), whether a worker's copy of the dataset is the one the pass was
planned over, the sources an endless pass refuses, and the shuffle mode a setting means."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable

from torch.utils.data import get_worker_info

from evenly.core.order import SHUFFLE_MODES
from evenly.core.plan import EpochPlan
from evenly.core.source import SourceView
from evenly.core.spec import PassSpec
from evenly.errors import EvenlyWarning
from evenly.options import Shuffle

__all__ = [
    "check_current",
    "shuffle_mode",
    "uneven_batches",
    "warn_about",
    "warn_skipped",
]

logger = logging.getLogger("evenly")


def warn_about(plan: EpochPlan, num_workers: int, rank: int, *, batches: bool = True) -> None:
    """Warn, in the main process, about padding, uneven ranks, idle workers and empty
    sources; ``batches``: the plan's units are the loader's batches (False under a plain
    DataLoader, whose batches the dataset does not know)."""
    if plan.num_samples == 0:
        warnings.warn(
            "evenly: the source is empty, so every rank yields 0 batches this epoch",
            EvenlyWarning,
            stacklevel=3,
        )
        return
    if plan.num_padded:
        warnings.warn(f"evenly: {plan.describe()}", EvenlyWarning, stacklevel=3)
    uneven = uneven_batches(plan, batches=batches)
    if uneven:
        warnings.warn(uneven, EvenlyWarning, stacklevel=3)
    idle = plan.idle_workers(num_workers)
    if idle:
        warnings.warn(
            f"evenly: rank {rank} has {plan.num_batches} batch(es) this epoch for "
            f"{max(num_workers, 1)} workers: {idle} worker(s) idle",
            EvenlyWarning,
            stacklevel=3,
        )


def uneven_batches(plan: EpochPlan, *, batches: bool = True) -> str | None:
    """Under ``pad="none"``, when the ranks get different batch counts this epoch: the
    warning naming them (a collective at every step hangs or fails on the rank with
    more), else None.  The same on every rank: it depends on the plan only.
    ``batches=False``: the plan's units are samples, batched by a plain DataLoader.

    >>> print(uneven_batches(EpochPlan(num_samples=11, world_size=2, pad="none")))
    evenly: pad='none' gives the 2 ranks different batch counts in epoch 0 (rank 0: 6, \
rank 1: 5 batches), so a collective at every step (an all_reduce of a metric, DDP's \
gradient sync, gather_for_metrics) hangs or fails on the ranks with more; use \
pad='mask' (equal batches, evenly.is_padding() marks the repeats) or sync the metric \
once after the loop
    """
    if plan.pad != "none" or plan.world_size == 1:
        return None
    counts = [plan.rank_batches(r) for r in range(plan.world_size)]
    if counts[0] == counts[-1]:
        return None
    more = counts.count(counts[0])  # ranks 0..more-1 get one batch more than the rest
    groups = [(0, more - 1, counts[0]), (more, plan.world_size - 1, counts[-1])]
    per_rank = ", ".join(
        f"rank {lo}: {n}" if lo == hi else f"ranks {lo}-{hi}: {n}" for lo, hi, n in groups
    )
    counted = (
        f"different batch counts in epoch {plan.epoch} ({per_rank} batches)"
        if batches
        else f"different sample counts in epoch {plan.epoch} ({per_rank} samples), so "
        f"their batch counts may differ too"
    )
    return (
        f"evenly: pad='none' gives the {plan.world_size} ranks {counted}, so a "
        f"collective at every step (an "
        f"all_reduce of a metric, DDP's gradient sync, gather_for_metrics) hangs or fails "
        f"on the ranks with more; use pad='mask' (equal batches, evenly.is_padding() marks "
        f"the repeats) or sync the metric once after the loop"
    )


def check_current(
    spec: PassSpec,
    n: int,
    generation: int,
    seen: list[int] | None,
    fingerprint: Callable[[], int],
) -> None:
    """Raise if a copy of a dataset (``n`` samples, ``generation``) is not the one the pass
    ``spec`` was planned over; ``seen`` is (len, fingerprint, generation) as the main
    process last saw them (``-1`` for a length never seen), for the dataset's own passes."""
    stale = ""
    if n != spec.num_samples:
        stale = f"len(source) is {n} here but {spec.num_samples} when the pass started"
    elif spec.generation != generation:
        stale = "dataset.source or dataset.transform was replaced in the main process"
    elif seen is not None:
        seen_n, seen_fp, seen_gen = seen
        if seen_gen != generation:
            stale = "dataset.source or dataset.transform was replaced in the main process"
        elif seen_n != -1 and n != seen_n:
            stale = f"len(source) is {n} here but {seen_n} in the main process"
        elif seen_n != -1 and fingerprint() != seen_fp:
            stale = "the source's fingerprint differs from the main process's"
    if stale:
        where = "this DataLoader worker" if get_worker_info() is not None else "here"
        raise RuntimeError(
            f"evenly: the source changed since {where} got its copy of the dataset "
            f"(epoch {spec.epoch}): {stale}.  Persistent DataLoader workers keep the "
            f"dataset they started with: use evenly.DataLoader (it restarts them), or "
            f"build a new DataLoader after changing the data"
        )


def warn_skipped(skipped: int, plan: EpochPlan) -> None:
    """At a pass end under ``on_error="skip"``: how many samples this rank replaced."""
    if skipped:
        warnings.warn(
            f"evenly: on_error='skip' replaced {skipped} unreadable sample(s) in epoch "
            f"{plan.epoch} on this rank with other samples, so every rank kept its "
            f"{plan.num_batches} batches; each is logged by the 'evenly' logger",
            EvenlyWarning,
            stacklevel=4,
        )


def shuffle_mode(shuffle: Shuffle, view: SourceView) -> str:
    """'none', 'global' or 'block'; ``True`` takes the source's preferred mode."""
    source = view.source
    if shuffle is True:
        mode: object = view.preferred_shuffle
        logger.info("evenly: shuffle=True uses the %r shuffle for %s", mode, type(source).__name__)
    elif shuffle is False:
        mode = "none"
    else:
        mode = shuffle
    message = view.shuffle_advice(str(mode)) if view.shuffle_advice is not None else None
    if message:
        logger.warning(message)
    if mode not in SHUFFLE_MODES:
        raise ValueError(f"shuffle must be True, False, 'global' or 'block', got {shuffle!r}")
    if mode == "block" and view.shard_sizes is None:
        raise ValueError(
            f"shuffle='block' needs a sharded source with shard_sizes (evenly.from_parquet, "
            f"from_webdataset, from_jsonl); {type(source).__name__} has none: use "
            f"shuffle='global'"
        )
    return str(mode)
