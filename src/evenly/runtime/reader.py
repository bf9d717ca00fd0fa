"""Reading one worker's share of a pass: fetch samples from the source batch by batch,
transform them under their own seeds, and name the sample at fault when anything fails.

With ``on_error="skip"`` a sample the source cannot read is replaced by another one (a
fixed function of its position), so every rank keeps its batch count; replacements are
counted in a shared slot per worker and logged.  With ``on_error="raise"`` nothing is
ever read twice: a failing read raises at once, naming the sample (or the batch, when
the source reads a batch in one call and cannot say which sample failed); only a
columnar read of several batches in one call that fails is read again, one batch at a
time, to hand out the batches before the failing one and name that one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from operator import length_hint
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from evenly.core.plan import EpochPlan
from evenly.core.source import SourceView
from evenly.core.stream import StreamPlan
from evenly.runtime.clock import StageClock, perf_counter
from evenly.runtime.rowtap import RowPieces, RowsTap
from evenly.runtime.seeds import RngState, SeedSpreader

if TYPE_CHECKING:
    from evenly.sources._fetch import Hold

__all__ = ["MAX_GROUP", "ReadContext", "read_columnar", "read_samples"]

logger = logging.getLogger("evenly")

#: Alternatives tried for an unreadable sample before giving up (on_error="skip").
MAX_REPLACEMENTS = 16


@dataclass
class ReadContext:
    """Everything a worker needs to read its share."""

    view: SourceView
    plan: EpochPlan | StreamPlan
    rank: int
    num_workers: int
    worker_id: int
    transform: Callable[[Any], Any] | None = None
    on_error: str = "raise"
    skipped: torch.Tensor | None = None  # shared per-worker counters
    progress: list[int] = field(default_factory=lambda: [0])  # samples handed out so far
    generators: tuple[str, ...] = ("random", "numpy", "torch")
    #: sees each batch's source indices and samples (the audit), after the transform
    tap: Callable[[list[int], list[Any]], list[Any]] | None = None
    #: times each batch's read and transform (``loader.stats()``)
    clock: StageClock = field(default_factory=StageClock)
    #: sees each batch of packed rows and their pieces (the audit, ``pack=``)
    rows_tap: RowsTap | None = None
    #: the pieces of the batch of packed rows just read, while ``rows_tap`` watches
    tapped: RowPieces | None = None

    @property
    def source(self) -> Any:
        return self.view.source

    def locate(self, index: int) -> str:
        locate = self.view.locate
        if locate is None:
            return ""
        try:
            return f", {locate(index)}"
        except Exception:  # the note must never hide the original error
            return ""

    def note(self, exc: BaseException, what: str, index: int | None = None) -> None:
        """Name the failing sample or batch (epoch, rank, worker, file/row)."""
        if not hasattr(exc, "add_note"):  # Python 3.10
            return
        where = "" if index is None else self.locate(index)
        exc.add_note(
            f"evenly: while reading {what} of epoch {self.plan.epoch}, rank {self.rank}, "
            f"worker {self.worker_id}{where}"
        )


def _chunks(ctx: ReadContext, skip: int) -> tuple[Iterator[tuple[Any, int]], int]:
    """This worker's plan chunks from its sample ``skip`` on, and the samples of the
    first batch to drop; starts the clock."""
    plan = ctx.plan
    ctx.clock.start(ctx.view.io_stats)
    first, drop = divmod(skip, plan.batch_size)
    chunks = plan.iter_worker_chunks(ctx.rank, ctx.num_workers, ctx.worker_id, first=first)
    return chunks, drop


def read_samples(ctx: ReadContext, skip: int = 0) -> Iterator[list[Any]]:
    """Yield this worker's batches in order, from its sample ``skip`` on: a list of
    samples per batch."""
    plan = ctx.plan
    getitems, prefetch, tap = ctx.view.getitems, ctx.view.prefetch, ctx.tap
    clock, io_stats = ctx.clock, ctx.view.io_stats
    chunks, drop = _chunks(ctx, skip)
    spreader = SeedSpreader(ctx.generators) if ctx.transform is not None else None
    upcoming = ((p, plan.indices(p).tolist(), n) for p, n in chunks)
    current = next(upcoming, None)
    ahead = LookAhead(prefetch)
    while current is not None:
        positions, indices, length = current
        following = next(upcoming, None)
        if following is not None:
            ahead.hint(following[1])  # the shards needed next download while we read
        current = following
        seeds = plan.seeds(positions) if spreader is not None else None
        where = positions.tolist()
        for lo in range(0, len(indices), length):
            batch, pos = indices[lo : lo + length], where[lo : lo + length]
            if ahead.before_first:
                ahead.reading(indices[lo:])
            started = perf_counter()
            samples = _fetch(ctx, getitems, batch, pos)
            read = perf_counter()
            clock.read += read - started
            ahead.first_read()
            if io_stats is not None:
                clock.count(io_stats)
            if spreader is not None and seeds is not None:
                spreader.prepare(seeds[lo : lo + length])
                samples = _transform(ctx, spreader, samples, batch, pos)
                clock.transform += perf_counter() - read
            if drop:
                samples, batch, drop = samples[drop:], batch[drop:], 0
            if tap is not None:
                samples = tap(batch, samples)
            ctx.progress[0] += len(samples)
            clock.samples += len(samples)
            yield samples


class LookAhead:
    """The plan's look-ahead hints to the source (``prefetch``), held back until the
    pass's first batch is read: until then that batch's own reads (its shards, or its
    samples by range) have the link to themselves, and the first batch comes as soon as
    its own bytes are in, not behind the next windows' downloads.  They go out just
    before that read, under a :class:`~evenly.sources._fetch.Hold`: a shard cache starts
    their downloads as soon as the batch has the shards it asked for (while it decodes),
    at the latest once it is read.

    >>> seen = []
    >>> ahead = LookAhead(seen.append)
    >>> ahead.hint([5, 6]); seen
    []
    >>> ahead.before_first, ahead.reading([3, 4]), seen
    (True, None, [[3, 4], [5, 6]])
    >>> ahead.first_read(); ahead.hint([7]); seen
    [[3, 4], [5, 6], [7]]
    """

    __slots__ = ("_held", "_hold", "_prefetch")

    def __init__(self, prefetch: Callable[[list[int]], None] | None) -> None:
        self._prefetch = prefetch
        self._held: list[list[int]] | None = [] if prefetch is not None else None
        self._hold: Hold | None = None

    def hint(self, indices: list[int]) -> None:
        """The plan's next samples (held until the first batch is read)."""
        if self._held is not None:
            self._held.append(indices)
        elif self._prefetch is not None and indices:
            self._prefetch(indices)

    @property
    def before_first(self) -> bool:
        """Whether the pass's first batch is still to be read (hints held)."""
        return self._held is not None

    def reading(self, upcoming: list[int]) -> None:
        """A batch is about to be read; before the pass's first one, ``upcoming`` (the
        samples of its plan chunk from that batch on: a source counting the reads it
        was told of counts this one too) and the held hints go out, in plan order,
        behind its reads."""
        held, self._held = self._held, None
        if held is None or self._prefetch is None:
            return
        from evenly.sources._fetch import Hold  # a source that prefetches imported it

        self._hold = Hold()
        with self._hold.holding():
            for indices in (upcoming, *held):
                if indices:
                    self._prefetch(indices)

    def first_read(self) -> None:
        """A batch was read: what went out behind the pass's first read may start."""
        hold, self._hold = self._hold, None
        if hold is not None:
            hold.release()


#: A grouped columnar read (several batches in one ``read_column_batches`` call) stays
#: under this many bytes of output, and under :data:`MAX_GROUP` batches.
GROUP_BYTES = 8 << 20
MAX_GROUP = 64


def read_columnar(ctx: ReadContext, skip: int = 0) -> Iterator[dict[str, Any]]:
    """This worker's batches in order, from its sample ``skip`` on, each a dict of
    columns (``source.read_columns``): with a source that reads several batches in one call
    (``read_column_batches``), the batches of a plan chunk are read in groups of up to
    :data:`GROUP_BYTES` (sized from the first batch), so the per-read work (the lookup,
    the check that each mapped file is unchanged) is done once per group.  A group whose
    read fails is read again batch by batch: the batches before the failing one are
    handed out and the failing one raises, naming its own samples."""
    plan, clock, io_stats, prefetch = ctx.plan, ctx.clock, ctx.view.io_stats, ctx.view.prefetch
    chunks, drop = _chunks(ctx, skip)
    grouped = ctx.view.read_column_batches
    group = 1  # batches per read: 1 until the first batch says how big a batch is
    upcoming = ((plan.indices(p), n) for p, n in chunks)
    current = next(upcoming, None)
    ahead = LookAhead(prefetch)
    while current is not None:
        indices, length = current
        current = next(upcoming, None)
        if current is not None:
            ahead.hint(current[0].tolist())  # the shards needed next download while we read
        batches = [indices[lo : lo + length] for lo in range(0, len(indices), length)]
        alone = 0  # batches to read one at a time (after a group read failed)
        while batches:
            started = perf_counter()
            part, batches = batches[: 1 if alone else group], batches[1 if alone else group :]
            alone = max(0, alone - 1)
            if ahead.before_first:
                ahead.reading(np.concatenate(part + batches).tolist())
            if grouped is not None and len(part) > 1:
                found = _fetch_group(grouped, part)
                if found is None:  # read again batch by batch: the error names its batch
                    batches, alone = part + batches, len(part)
                    continue
                read = found
            else:
                read = [_fetch_columns(ctx, b if grouped else b.tolist()) for b in part]
            clock.read += perf_counter() - started
            ahead.first_read()
            if io_stats is not None:
                clock.count(io_stats)
            if group == 1 and grouped is not None:
                size = sum(getattr(v, "nbytes", 0) for v in read[0].values())
                group = max(1, min(MAX_GROUP, GROUP_BYTES // max(size, 1)))
            read.reverse()  # handed out by pop(): nothing here holds a batch once it is out
            for batch in part:
                columns, rows = read.pop(), len(batch)
                if drop:
                    columns = {k: v[drop:] for k, v in columns.items()}
                    rows, drop = rows - drop, 0
                clock.samples += rows
                ctx.progress[0] += rows
                yield columns
            columns = {}


def _fetch_group(
    grouped: Callable[[list[Any]], list[dict[str, Any]]], part: list[Any]
) -> list[dict[str, Any]] | None:
    """The batches of ``part`` read in one call, or None if that read failed."""
    try:
        found = grouped(part)
    except Exception:
        return None
    return [_tensors(columns) for columns in found]


def _fetch_columns(ctx: ReadContext, batch: Any) -> dict[str, Any]:
    try:
        assert ctx.view.read_columns is not None  # chosen only for sources that have it
        columns: dict[str, Any] = ctx.view.read_columns(batch)
    except Exception as exc:
        first = [int(i) for i in batch[:8]]
        ctx.note(exc, f"a batch of samples {first}{'...' if len(batch) > 8 else ''}")
        raise
    return _tensors(columns)


def _tensors(columns: dict[str, Any]) -> dict[str, Any]:
    """numpy columns as tensors (sharing their memory); other values as they are."""
    return {
        name: torch.from_numpy(value)
        if type(value) is np.ndarray or hasattr(value, "__array_interface__")
        else value
        for name, value in columns.items()
    }


def _fetch(
    ctx: ReadContext,
    getitems: Callable[[list[int]], Any] | None,
    batch: list[int],
    positions: list[int],
) -> list[Any]:
    """Read a batch in one go.  With on_error="skip", a failing batch is read again one
    sample at a time to find and replace the sample at fault."""
    if getitems is None:
        if ctx.on_error == "skip":
            return [_fetch_one(ctx, i, p) for i, p in zip(batch, positions, strict=True)]
        pending = iter(batch)
        try:
            return list(map(ctx.view.read_one, pending))
        except Exception as exc:  # name the sample at fault: nothing is read again
            at = len(batch) - length_hint(pending) - 1  # the one being read
            if isinstance(exc, IndexError):
                raise _lying_len(ctx, [batch[at]], exc) from exc
            ctx.note(exc, f"sample {batch[at]} (position {positions[at]})", batch[at])
            raise
    try:
        return list(getitems(batch))
    except IndexError as exc:
        raise _lying_len(ctx, batch, exc) from exc
    except Exception as exc:
        if ctx.on_error != "skip":
            ctx.note(exc, f"a batch of samples {batch[:8]}{'...' if len(batch) > 8 else ''}")
            raise
    return [_fetch_one(ctx, i, p) for i, p in zip(batch, positions, strict=True)]


def _fetch_one(ctx: ReadContext, index: int, position: int) -> Any:
    try:
        return ctx.view.read_one(index)
    except IndexError as exc:
        raise _lying_len(ctx, [index], exc) from exc
    except Exception as exc:
        if ctx.on_error != "skip":
            ctx.note(exc, f"sample {index} (position {position})", index)
            raise
        return _replacement(ctx, index, position, exc)


def _replacement(ctx: ReadContext, index: int, position: int, error: Exception) -> Any:
    """Read another sample in place of an unreadable one, and count it."""
    n = ctx.plan.num_samples
    stride = max(1, n // (MAX_REPLACEMENTS + 1))
    for k in range(1, MAX_REPLACEMENTS + 1):
        alternative = int(ctx.plan.indices([(position % n + k * stride) % n])[0])
        try:
            sample = ctx.view.read_one(alternative)
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
    ctx.note(error, f"sample {index} (position {position})", index)
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
    ctx: ReadContext,
    spreader: SeedSpreader,
    samples: list[Any],
    batch: list[int],
    positions: list[int],
) -> list[Any]:
    """Apply the transform to each sample under its own seeds.

    The user's state of the seeded generators is put back before any sample leaves, so
    the training loop (and a collate_fn) never sees the per-sample streams.
    """
    transform = ctx.transform
    assert transform is not None
    out = []
    pads = ctx.plan.pads(positions).tolist()
    saved = RngState(ctx.generators)
    try:
        for i, sample in enumerate(samples):
            try:
                result = spreader.call(i, transform, sample, pads[i])
            except Exception as exc:
                ctx.note(exc, f"sample {batch[i]} (position {positions[i]})", batch[i])
                raise
            if result is None:
                raise TypeError(
                    f"evenly: the transform returned None for sample {batch[i]} (position "
                    f"{positions[i]}) of epoch {ctx.plan.epoch}, rank {ctx.rank}, worker "
                    f"{ctx.worker_id}{ctx.locate(batch[i])}: it must return the transformed "
                    f"sample (a function that changes its argument in place must return it)"
                )
            out.append(result)
    finally:
        saved.restore()
    return out
