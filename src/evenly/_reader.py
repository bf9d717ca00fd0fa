"""Reading one worker's share of an epoch: fetch samples from the source batch by batch,
transform them under their own seeds, and name the sample at fault when anything fails.

With ``on_error="skip"`` a sample the source cannot read is replaced by another one (a
fixed function of its position), so every rank keeps its batch count; replacements are
counted in a shared slot per worker and logged.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ._plan import EpochPlan
from ._rng import RngState, seed_all

__all__ = ["ReadContext", "read_share"]

logger = logging.getLogger("evenly")

#: Alternatives tried for an unreadable sample before giving up (on_error="skip").
MAX_REPLACEMENTS = 16


@dataclass
class ReadContext:
    """Everything a worker needs to read its share."""

    source: Any
    plan: EpochPlan
    rank: int
    num_workers: int
    worker_id: int
    transform: Callable[[Any], Any] | None = None
    on_error: str = "raise"
    skipped: torch.Tensor | None = None  # shared per-worker counters
    progress: list[int] | None = None  # samples handed out so far in this pass

    def locate(self, index: int) -> str:
        locate = getattr(self.source, "locate", None)
        if locate is None:
            return ""
        try:
            return f", {locate(index)}"
        except Exception:  # the note must never hide the original error
            return ""

    def note(self, exc: BaseException, index: int | None, position: int | None) -> None:
        """Name the failing sample (index, position, epoch, rank, worker, file/row)."""
        if not hasattr(exc, "add_note"):  # Python 3.10
            return
        what = "a batch" if index is None else f"sample {index} (position {position})"
        where = "" if index is None else self.locate(index)
        exc.add_note(
            f"evenly: while reading {what} of epoch {self.plan.epoch}, rank {self.rank}, "
            f"worker {self.worker_id}{where}"
        )


def read_share(ctx: ReadContext, skip: int = 0) -> Iterator[Any]:
    """Yield the samples of this worker's batches, in order, from sample ``skip`` on."""
    plan = ctx.plan
    getitems = getattr(ctx.source, "__getitems__", None)
    prefetch = getattr(ctx.source, "prefetch", None)
    first, drop = divmod(skip, plan.batch_size)
    chunks = plan.iter_worker_chunks(ctx.rank, ctx.num_workers, ctx.worker_id, first=first)
    upcoming = _with_indices(plan, chunks)
    current = next(upcoming, None)
    if current is not None and prefetch is not None:
        prefetch(current[1])
    while current is not None:
        positions, indices, length = current
        following = next(upcoming, None)
        if following is not None and prefetch is not None:
            prefetch(following[1])  # the shards needed next download while we read
        current = following
        where = positions.tolist()
        seeds = plan.seeds(positions).tolist() if ctx.transform is not None else []
        for lo in range(0, len(indices), length):
            batch, pos = indices[lo : lo + length], where[lo : lo + length]
            samples = _fetch(ctx, getitems, batch, pos)
            if ctx.transform is not None:
                samples = _transform(ctx, samples, seeds[lo : lo + length], batch, pos)
            if drop:
                samples, drop = samples[drop:], 0
            if ctx.progress is not None:
                ctx.progress[0] += len(samples)
            yield from samples


def _with_indices(
    plan: EpochPlan, chunks: Iterator[tuple[Any, int]]
) -> Iterator[tuple[Any, list[int], int]]:
    for positions, length in chunks:
        yield positions, plan.indices(positions).tolist(), length


def _fetch(
    ctx: ReadContext,
    getitems: Callable[[list[int]], Any] | None,
    batch: list[int],
    positions: list[int],
) -> list[Any]:
    """Read a batch in one go; on an error, read it again one sample at a time to name
    (or, with on_error="skip", replace) the sample at fault."""
    try:
        if getitems is not None:
            return list(getitems(batch))
        source = ctx.source
        return [source[index] for index in batch]
    except IndexError as exc:
        raise _lying_len(ctx, batch, exc) from exc
    except Exception as exc:
        if getitems is not None and ctx.on_error != "skip":
            ctx.note(exc, None, None)
            raise
    return [_fetch_one(ctx, i, p) for i, p in zip(batch, positions, strict=True)]


def _fetch_one(ctx: ReadContext, index: int, position: int) -> Any:
    try:
        return ctx.source[index]
    except IndexError as exc:
        raise _lying_len(ctx, [index], exc) from exc
    except Exception as exc:
        if ctx.on_error != "skip":
            ctx.note(exc, index, position)
            raise
        return _replacement(ctx, index, position, exc)


def _replacement(ctx: ReadContext, index: int, position: int, error: Exception) -> Any:
    """Read another sample in place of an unreadable one, and count it."""
    n = ctx.plan.num_samples
    stride = max(1, n // (MAX_REPLACEMENTS + 1))
    for k in range(1, MAX_REPLACEMENTS + 1):
        alternative = int(ctx.plan.indices([(position % n + k * stride) % n])[0])
        try:
            sample = ctx.source[alternative]
        except Exception:
            continue
        if ctx.skipped is not None:
            ctx.skipped[ctx.worker_id % ctx.skipped.numel()] += 1
        logger.warning(
            "evenly: skipped unreadable sample %d (position %d of epoch %d%s): %s: %s; "
            "replaced by sample %d",
            index,
            position,
            ctx.plan.epoch,
            ctx.locate(index),
            type(error).__name__,
            error,
            alternative,
        )
        return sample
    ctx.note(error, index, position)
    if hasattr(error, "add_note"):
        error.add_note(
            f"evenly: on_error='skip' found no readable replacement in {MAX_REPLACEMENTS} tries"
        )
    raise error


def _lying_len(ctx: ReadContext, batch: list[int], exc: IndexError) -> IndexError:
    return IndexError(
        f"evenly: the source raised IndexError for sample(s) {batch[:8]} although "
        f"len(source) = {ctx.plan.num_samples}: its __len__ promises more samples than "
        f"__getitem__ can read (rank {ctx.rank}, worker {ctx.worker_id}): {exc}"
    )


def _transform(
    ctx: ReadContext, samples: list[Any], seeds: list[int], batch: list[int], positions: list[int]
) -> list[Any]:
    """Apply the transform to each sample under its own seed.

    The user's RNG state is put back before any sample leaves, so the training loop (and
    a collate_fn) never sees the per-sample streams.
    """
    assert ctx.transform is not None
    out = []
    saved = RngState()
    try:
        for i, (sample, seed) in enumerate(zip(samples, seeds, strict=True)):
            seed_all(seed)
            try:
                out.append(ctx.transform(sample))
            except Exception as exc:
                ctx.note(exc, batch[i], positions[i])
                raise
    finally:
        saved.restore()
    return out
