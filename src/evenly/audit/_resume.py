"""The rank side of ``evenly audit``: one run of the factory's loader through the epochs,
as a training loop drives it, recording every sample it delivers.

The plain audit runs every epoch uninterrupted, with the lengths the loader reported
before each pass (``collect``).  ``--resume`` adds the runs that stop at a batch and save
the loader's state, and the fresh runs that load it and finish (``reference_task``,
``resume_task``); all are the same run (``_run``).  ``evenly.DataLoader`` knows its epoch
(``loader.epoch``): after a load the loop runs passes until it reaches the audit's last
epoch.  Any other loader (torch's or torchdata's ``StatefulDataLoader`` over a dataset,
a ``LoaderFactory``'s own loader) is told the epoch: ``set_epoch(e)`` before each pass,
and after a load the loop starts at the stop's epoch (the next one for a state saved
after the pass ended: an epoch-boundary checkpoint).  A state is pickled where it is
saved and unpickled where it is loaded, as a checkpoint file would carry it.
"""

from __future__ import annotations

import gc
import pickle
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ._collect import Columns, Job, RankResult, _length, _WarningLog, build_loader
from ._factory import describe
from ._launch import launch, seen_here, tell, working_on
from ._sourceinfo import mix_info, pack_info, reweigh
from ._trace import metas_of
from ._types import RankEpoch, Settings

__all__ = [
    "Resumed",
    "Stop",
    "choose_stops",
    "collect",
    "reference_task",
    "resume_task",
]

#: Batches between two progress lines from rank 0 (uninterrupted runs).
PROGRESS_EVERY = 250


@dataclass(frozen=True)
class Stop:
    """Where every rank stops: after ``batch`` batches of ``epoch`` (``end_of_pass``: after
    the pass ended, an epoch-boundary checkpoint).  ``then``: where the resumed run stops
    again, for a second resume."""

    name: str
    epoch: int
    batch: int
    end_of_pass: bool = False
    then: Stop | None = None
    #: after the epoch's last batch (inside the loop): a state the loader may take for
    #: that epoch's end or for the next epoch's start
    last: bool = False

    def __str__(self) -> str:
        where = "the end of" if self.end_of_pass else f"batch {self.batch} of"
        return f"{self.name} ({where} epoch {self.epoch})"


def choose_stops(batches: list[int], epochs: int, at: tuple[float, ...] = ()) -> list[Stop]:
    """The interruption points for epochs of ``batches`` batches per rank (the fewest over
    ranks): early, middle, the last batch, the epoch boundary, a second resume, and one
    after each fraction ``at`` of the first epoch's batches.

    >>> [str(s) for s in choose_stops([6, 6], 2)]  # doctest: +NORMALIZE_WHITESPACE
    ['early (batch 1 of epoch 0)', 'middle (batch 3 of epoch 0)',
     'last batch (batch 6 of epoch 0)', 'epoch boundary (the end of epoch 0)',
     'second resume (batch 2 of epoch 0)']
    """
    n0 = batches[0] if batches else 0
    if n0 < 1:
        return []
    stops = []
    if n0 >= 3:
        stops.append(Stop("early", 0, 1))
    if n0 >= 2:
        stops.append(Stop("middle", 0, n0 // 2))
    stops.append(Stop("last batch", 0, n0, last=True))
    if epochs >= 2:
        stops.append(Stop("epoch boundary", 0, n0, end_of_pass=True))
    n1 = batches[1] if len(batches) > 1 else 0
    first = max(1, n0 // 3)
    if epochs >= 2 and n1 >= 1:
        then = Stop("second resume", 1, max(1, n1 // 2))
    elif n0 - first >= 1:
        then = Stop("second resume", 0, first + max(1, (n0 - first) // 2))
    else:
        then = None
    if then is not None:
        stops.append(Stop("second resume", 0, first, then=then))
    for frac in at:
        stops.append(Stop(f"at {frac:g}", 0, min(n0, max(1, round(frac * n0)))))
    return stops


@dataclass
class Resumed:
    """One rank's run between a load (or the start) and a save (or the end)."""

    result: RankResult
    #: the pickled state saved at the stop (None: the run went to the end)
    state: bytes | None = None
    #: why the state could not be loaded (another topology?) or saved
    error: str | None = None
    #: ``len(loader)`` after the load, if not what this rank had received in the
    #: interrupted epoch + the batches left (the standing rule)
    length_error: str | None = None
    #: why the audit cannot save and load this loader's state (an uninterrupted run)
    cannot: str | None = None


def _last_line(exc: BaseException) -> str:
    """The message of ``exc`` (a worker's error: the last line of its traceback)."""
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else type(exc).__name__


class _Saved(Exception):
    """The run reached its stop."""


def _run(
    job: Job,
    settings: Settings,
    rank: int,
    *,
    state: bytes | None = None,
    start: Stop | None = None,
    until: Stop | None = None,
) -> Resumed:
    """Build the loader fresh and run it: every epoch uninterrupted (no ``start``, no
    ``until``: with the lengths reported before each pass, the expected count and what the
    Mix or packing planned), or load ``state`` (saved at ``start``), run to ``until`` (or
    the last epoch) and save there."""
    result = RankResult(rank=rank, seen=seen_here())
    columns = Columns()
    log = _WarningLog()
    out = Resumed(result)
    first_batch: dict[int, int] = {}
    plain = start is None and until is None
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = log
        built = build_loader(job, settings)
        loader, managed = built.loader, built.managed
        if plain:
            result.expected, result.expected_source = built.expected()
        epoch = 0
        loaded: int | None = None  # the epoch set (and loaded) before the first pass
        length_after: int | None = None
        if start is not None and state is not None:
            epoch = start.epoch + 1 if start.end_of_pass else start.epoch
            if not managed:
                built.set_epoch(epoch)
            try:
                loader.load_state_dict(pickle.loads(state))
            except Exception as exc:
                out.error = f"{type(exc).__name__}: {exc}"
                return out
            loaded = epoch
            if not start.end_of_pass:
                first_batch[start.epoch] = start.batch
            length_after = _length(loader)
        try:
            for _ in range(settings.epochs + 2):  # a loader stuck in one epoch ends too
                if managed and not plain:
                    epoch = loader.epoch
                if epoch >= settings.epochs:
                    break
                if not managed and epoch != loaded:
                    built.set_epoch(epoch)
                if plain:  # what the loader says the pass holds
                    reported = built.reported()
                    reported_batches = _length(loader)
                done = first_batch.get(epoch, 0)
                samples = 0
                for item in loader:
                    metas = metas_of(item)
                    columns.add(epoch, metas)
                    samples += metas.samples
                    done += 1
                    reweigh(loader, settings, epoch, done)
                    here = (until.epoch, until.batch, until.end_of_pass) if until else None
                    if here == (epoch, done, False):
                        out.state = pickle.dumps(loader.state_dict())
                        raise _Saved
                    if plain and done % PROGRESS_EVERY == 0:
                        tell(f"{describe(job.factory)}: epoch {epoch}, batch {done}")
                if until is not None and until.end_of_pass and until.epoch == epoch:
                    out.state = pickle.dumps(loader.state_dict())
                    raise _Saved
                if plain:
                    result.per_rank.append(
                        RankEpoch(rank, epoch, samples, done, reported, reported_batches)
                    )
                loaded = None
                if plain or not managed:
                    epoch += 1
        except _Saved:
            pass
        except Exception as exc:
            if loaded is None and start is None:
                raise  # not a resume: the audit cannot run
            # a state applied lazily (StatefulDataLoader's workers) fails here
            out.error = f"{type(exc).__name__} after loading the state: {_last_line(exc)}"
            return out
    if start is not None and state is not None and length_after is not None:
        out.length_error = _length_error(start, until, rank, length_after, columns.epochs)
    if plain:
        out.cannot = built.resumable()
        result.mix = mix_info(built.inner, settings)
        result.pack = pack_info(built.inner, settings.epochs, settings)
    columns.fill(result, first_batch)
    result.warnings = log.lines() + result.warnings
    del loader, built
    gc.collect()  # the stopped loader's workers go now, not during the next run
    return out


def _length_error(
    start: Stop, until: Stop | None, rank: int, reported: int, epochs: list[int]
) -> str | None:
    """``len(loader)`` right after loading the state saved at ``start``, against the
    batches this rank had received in that epoch + those it received after the load
    (when the run went to that epoch's end).  A state saved after an epoch's last batch
    may be that epoch's end or the next one's start: either count is right."""
    epoch = start.epoch + 1 if start.end_of_pass else start.epoch
    received = 0 if start.end_of_pass else start.batch

    def left(e: int) -> int | None:
        if until is not None and (until.epoch, until.end_of_pass) <= (e, False):
            return None  # stopped again inside that epoch: what was left is not known
        return sum(1 for x in epochs if x == e)

    here = left(epoch)
    if here is None:
        return None
    right = {received + here}
    if here == 0 and received:  # nothing left: the state may be the next epoch's start
        after = left(epoch + 1)
        right |= set() if after is None else {after}
    if start.last and not start.end_of_pass:  # the pass after the load: the next epoch?
        right.add(here)
    if reported in right:
        return None
    return (
        f"rank {rank}: len(loader) was {reported} after loading the state, not the "
        f"{received} batches received in epoch {epoch} + {here} left = {received + here}"
    )


def _agree(counts: list[int]) -> list[int]:
    """The fewest batches per epoch over all ranks."""
    t = torch.tensor(counts, dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return [int(v) for v in t.tolist()]


def reference_task(
    rank: int, payload: tuple[list[Job], Settings]
) -> list[tuple[RankResult, str | None, list[Stop], list[Resumed]]]:
    """Per job: the uninterrupted run, why it cannot resume (or None), the stops and the
    run stopped at each (every rank stops at the same batch)."""
    jobs, settings = payload
    out: list[tuple[RankResult, str | None, list[Stop], list[Resumed]]] = []
    for job in jobs:
        working_on(describe(job.factory))
        plain = _run(job, settings, rank)
        reference, why = plain.result, plain.cannot
        counts = [r.batches for r in sorted(reference.per_rank, key=lambda r: r.epoch)]
        stops = choose_stops(_agree(counts), settings.epochs, settings.resume_at)
        if why is not None:
            out.append((reference, why, [], []))
            continue
        runs = []
        for i, stop in enumerate(stops):
            tell(f"{describe(job.factory)}: stop {i + 1} of {len(stops)}, {stop}")
            runs.append(_run(job, settings, rank, until=stop))
        out.append((reference, None, stops, runs))
    return out


#: One resumed run: the job, its settings, the stop it resumes from, the state of each
#: rank saved there, and where to stop again.
ResumeItem = tuple[Job, Settings, Stop, list[bytes], "Stop | None"]


def own_states(states: list[bytes]) -> bool:
    """Whether the ranks saved different states (each rank then loads its own)."""
    return len(set(states)) > 1


def resume_task(rank: int, items: list[ResumeItem]) -> list[Resumed]:
    """Each item in a fresh loader: load the state, finish (or stop at ``then``)."""
    out = []
    for i, (job, settings, stop, states, then) in enumerate(items):
        working_on(f"{describe(job.factory)} resumed from {stop}")
        tell(f"resume {i + 1} of {len(items)}: {stop}")
        state = states[rank] if own_states(states) else states[0]
        out.append(_run(job, settings, rank, state=state, start=stop, until=then))
    return out


def _run_jobs(rank: int, payload: tuple[list[Job], Settings]) -> list[RankResult]:
    jobs, settings = payload
    out = []
    for job in jobs:
        working_on(describe(job.factory))
        out.append(_run(job, settings, rank).result)
    return out


def collect(
    jobs: list[Job], settings: Settings, progress: Callable[[str], None] | None = None
) -> list[list[RankResult]]:
    """Run every job uninterrupted in ``settings.world_size`` fresh rank processes on
    ``settings.nodes`` simulated nodes (one group for all jobs); return, per job, the
    ``RankResult`` of each rank in rank order."""
    per_rank = launch(
        settings.world_size,
        settings.timeout,
        _run_jobs,
        (jobs, settings),
        progress,
        nodes=settings.nodes,
    )
    return [[per_rank[r][j] for r in range(settings.world_size)] for j in range(len(jobs))]
