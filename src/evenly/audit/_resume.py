"""``evenly audit``'s runs of a factory's loader through the epochs, and ``--resume``.

The rank side: one run of the loader as a training loop drives it, recording every sample
it delivers (``_run``).  The plain audit runs every epoch uninterrupted, with the lengths
the loader reported before each pass (``collect``).  ``--resume`` adds the runs that stop
at a batch and save the loader's state, and the fresh runs that load it and finish
(``reference_task``, ``resume_task``): the same run.  ``evenly.DataLoader`` knows its
epoch (``loader.epoch``): after a load the loop runs passes until it reaches the audit's
last epoch.  Any other loader (torch's or torchdata's ``StatefulDataLoader`` over a
dataset, a ``LoaderFactory``'s own loader) is told the epoch: ``set_epoch(e)`` before
each pass, and after a load the loop starts at the stop's epoch (the next one for a state
saved after the pass ended: an epoch-boundary checkpoint).  A state is pickled where it
is saved and unpickled where it is loaded, as a checkpoint file would carry it.

The launches of ``--resume`` (``run_resume``), and the findings they lead to:

1. The reference: ``world_size`` fresh ranks run every job uninterrupted (its records
   are the plain audit's), then, for each stop, a fresh loader that stops every rank at
   that batch and saves its state.
2. The resumes: fresh rank processes (``resume_world_size`` x ``resume_workers`` where
   the state does not depend on the rank: every rank saved the same bytes; otherwise the
   same world size, and a "cannot resume onto another topology" warning) build the loader
   fresh, load the state and finish the epochs.  A state that does not load onto the
   other topology is tried again on the original one (a warning too).
3. The second resume: the run resumed from the "second resume" stop saves again later
   on; fresh processes load that and finish.

Every stop is then compared with the reference (``_resumecheck``): one finding per stop,
FAIL on a defect (missing, repeated, reordered, wrong epoch, ranks with unequal batches
after a load), and a ``resume`` finding that says onto what the loader resumed, WARN
where it could not.
"""

from __future__ import annotations

import functools
import gc
import pickle
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ._collect import Columns, Job, RankResult, _length, _WarningLog, build_loader
from ._coverage import merged_pieces, pieces_coverage, source_counts
from ._factory import describe
from ._launch import launch, seen_here, tell, working_on
from ._resumecheck import Run, balance_problems, check_stop, prefix_matches
from ._sourceinfo import mix_info, pack_info, reweigh
from ._trace import metas_of
from ._types import I64, Finding, MixInfo, PackInfo, RankEpoch, Settings, Status, stacked

__all__ = [
    "ResumeReport",
    "Resumed",
    "Stop",
    "StopRun",
    "choose_stops",
    "collect",
    "reference_task",
    "resume_findings",
    "resume_task",
    "run_resume",
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


@dataclass
class StopRun:
    """One stop of one job: where it resumed, the per-rank runs (seg 0: before the stop
    under the audit's topology, 1: after the load, 2: after the second load)."""

    stop: Stop
    world_size: int
    num_workers: int
    segments: list[list[RankResult]] = field(default_factory=list)
    error: str | None = None
    notes: list[str] = field(default_factory=list)
    #: every delivered sample of the run, encoded (set by ``resume_findings``)
    run: Run | None = None
    #: ``len(loader)`` after a load that broke the standing rule, per rank
    length_errors: list[str] = field(default_factory=list)
    #: the simulated nodes it resumed on
    nodes: int = 1

    def onto(self) -> str:
        """Where it resumed: ranks x workers, and the nodes where more than one."""
        on = f" on {self.nodes} nodes" if self.nodes > 1 else ""
        return f"{self.world_size} ranks x {self.num_workers} workers{on}"


@dataclass
class ResumeReport:
    """What the resume audit of one job ran and found."""

    cannot: str | None = None
    stops: list[StopRun] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    #: the uninterrupted run, encoded (set by ``resume_findings``)
    reference: Run | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "cannot_resume": self.cannot,
            "stops": [
                {
                    "stop": str(s.stop),
                    "world_size": s.world_size,
                    "num_workers": s.num_workers,
                    "nodes": s.nodes,
                    "error": s.error,
                    "notes": s.notes,
                }
                for s in self.stops
            ],
        }


def _errors(runs: list[Resumed]) -> str:
    """Each rank's error, named ("" when none failed)."""
    return "; ".join(f"rank {r}: {run.error}" for r, run in enumerate(runs) if run.error)


def _states(runs: list[Resumed]) -> tuple[list[bytes] | None, str | None]:
    errors = _errors(runs)
    if errors:
        return None, errors
    states = [run.state for run in runs]
    if any(s is None for s in states):
        return None, "a rank ended before the stop (fewer batches than the others?)"
    return [s for s in states if s is not None], None


def _slug(stop: Stop) -> str:
    return "resume_" + "".join(c if c.isalnum() else "_" for c in stop.name)


class _Plan:
    """The resumes still to run: items grouped by world size and nodes, and where each
    goes."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.items: dict[tuple[int, int], list[tuple[ResumeItem, StopRun]]] = {}

    def add(
        self, job: Job, stop: Stop, states: list[bytes], then: Stop | None, target: StopRun
    ) -> None:
        """Resume ``job`` from the ``states`` saved at ``stop`` onto ``target``'s topology
        (and stop again at ``then``)."""
        settings = replace(
            self.settings,
            num_workers=target.num_workers,
            world_size=target.world_size,
            nodes=target.nodes,
        )
        item: ResumeItem = (job, settings, stop, states, then)
        self.items.setdefault((target.world_size, target.nodes), []).append((item, target))

    def run(
        self, timeout: float, say: Callable[[str], None]
    ) -> list[tuple[ResumeItem, StopRun, list[Resumed]]]:
        done = []
        for (world_size, nodes), pairs in sorted(self.items.items()):
            items = [item for item, _ in pairs]
            per_rank = launch(world_size, timeout, resume_task, items, say, nodes=nodes)
            for i, (item, target) in enumerate(pairs):
                done.append((item, target, [per_rank[r][i] for r in range(world_size)]))
        self.items = {}
        return done


def run_resume(
    jobs: list[Job],
    settings: Settings,
    *,
    world_size: int | None = None,
    num_workers: int | None = None,
    nodes: int | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[tuple[list[RankResult], ResumeReport]]:
    """Per job: the reference's rank results and the resume report (findings unset:
    ``resume_findings`` computes them once the ids are encoded)."""
    say = progress or (lambda _: None)
    w2 = settings.world_size if world_size is None else world_size
    k2 = settings.num_workers if num_workers is None else num_workers
    n2 = settings.nodes if nodes is None else nodes
    say(f"reference and interrupted runs on {settings.world_size} ranks")
    per_rank = launch(
        settings.world_size,
        settings.timeout,
        reference_task,
        (jobs, settings),
        say,
        nodes=settings.nodes,
    )
    out: list[tuple[list[RankResult], ResumeReport]] = []
    plan = _Plan(settings)
    for j, job in enumerate(jobs):
        refs = [per_rank[r][j][0] for r in range(settings.world_size)]
        report = ResumeReport(cannot=per_rank[0][j][1])
        out.append((refs, report))
        for i, stop in enumerate(per_rank[0][j][2]):
            runs = [per_rank[r][j][3][i] for r in range(settings.world_size)]
            target = StopRun(stop, w2, k2, segments=[[run.result for run in runs]], nodes=n2)
            report.stops.append(target)
            states, error = _states(runs)
            if states is None:
                target.error = f"the state saved at {stop} is unusable: {error}"
                continue
            if own_states(states) and w2 != settings.world_size:
                target.notes.append(
                    f"cannot resume onto another topology: the state differs per rank, so "
                    f"it resumed on {settings.world_size} ranks, not {w2}"
                )
                target.world_size, target.nodes = settings.world_size, settings.nodes
            plan.add(job, stop, states, stop.then, target)
    say(f"resumed runs on {w2} ranks x {k2} workers" + (f" on {n2} nodes" if n2 > 1 else ""))
    home = (settings.world_size, settings.num_workers)
    # three rounds: the resumes (a failed one onto another topology is tried again at
    # home), then those retries and the second resumes, then the retries' second resumes
    for round_ in range(3):
        if round_ == 2:
            say("second resume")
        for item, target, runs in plan.run(settings.timeout, say):
            errors = _errors(runs)
            if round_ == 0 and errors and (target.world_size, target.num_workers) != home:
                target.notes.append(
                    f"cannot resume onto {target.world_size} ranks x {target.num_workers} "
                    f"workers ({errors}): resumed on {home[0]} x {home[1]}"
                )
                target.world_size, target.num_workers = home
                target.nodes = settings.nodes
                job, _, stop, states, then = item
                plan.add(job, stop, states, then, target)
                continue
            _finish(item, target, runs, plan)
    return out


def _finish(item: ResumeItem, target: StopRun, runs: list[Resumed], plan: _Plan) -> None:
    """Record a resumed run; queue the second resume from where it saved again."""
    errors = _errors(runs)
    if errors:
        target.error = "cannot resume: load_state_dict raised: " + errors
        return
    target.segments.append([run.result for run in runs])
    target.length_errors += [run.length_error for run in runs if run.length_error]
    job, _, _, _, then = item
    if then is None:
        return
    states, error = _states(runs)
    if states is None:
        target.error = f"the state saved again at {then} is unusable: {error}"
        return
    plan.add(job, then, states, None, target)


def _run_of(results: list[RankResult], codes: list[np.ndarray], seg: int, world: int) -> Run:
    cols = stacked(results)
    ids = np.concatenate(codes) if codes else np.zeros(0, dtype=np.int64)
    seg_col = np.full(len(ids), seg, dtype=np.int64)
    names = ("rank", "epoch", "batch", "pos")
    return Run(world_size=world, ids=ids, seg=seg_col, **{n: cols[n] for n in names})


def _next_epoch(segs: list[Run], stop: Stop, epochs: int, world_size: int) -> Run:
    """The run with every pass after the load counted one epoch later (the epochs past
    the audit's last dropped), as if the loop had known the state was the next epoch's."""
    parts = [segs[0]]
    for seg in segs[1:]:
        batch = np.where(seg.epoch == stop.epoch, seg.batch - stop.batch, seg.batch)
        moved = replace(seg, epoch=seg.epoch + 1, batch=batch)
        parts.append(moved.select(moved.epoch < epochs))
    return Run.concat(parts, world_size)


def _shifted(segments: list[list[RankResult]], later: bool) -> list[tuple[RankResult, int]]:
    """Every result of the segments, with the epochs to add to its own (``later``: 1 after
    the load, see ``_next_epoch``)."""
    return [(r, int(later and k > 0)) for k, seg in enumerate(segments) for r in seg]


def resumed_tokens(
    pack: PackInfo, segments: list[list[RankResult]], epochs: int, later: bool = False
) -> list[str]:
    """The token accounting of a stopped and resumed packed run, per epoch (``later``:
    the passes after the load count one epoch later, see ``_next_epoch``)."""
    pairs = _shifted(segments, later)
    found = pieces_coverage(
        pack.lengths,
        epochs,
        np.concatenate([r.epoch + d for r, d in pairs]),
        np.concatenate([np.full(len(r.epoch), r.rank) for r, _ in pairs]),
        merged_pieces([r for r, _ in pairs]),
    )
    return [f"epoch {c.epoch}: {c.text}" for c in found]


def _per_source(mix: MixInfo, pairs: list[tuple[RankResult, int]], epochs: int) -> I64:
    """Samples per epoch and source of the results of ``pairs`` (each with the epochs
    added to its own, see ``_shifted``; samples of no known source are not counted)."""
    kept = [(r, d) for r, d in pairs if len(r.reads) == len(r.epoch)]
    if not kept:
        return np.zeros((epochs, len(mix.names)), dtype=np.int64)
    reads = np.concatenate([np.asarray(r.reads, dtype=np.int64).reshape(-1) for r, _ in kept])
    epoch = np.concatenate([np.asarray(r.epoch, dtype=np.int64) + d for r, d in kept])
    return source_counts(mix, reads, epoch, epochs)


def resumed_shares(
    mix: MixInfo,
    refs: list[RankResult],
    segments: list[list[RankResult]],
    epochs: int,
    step: int,
    later: bool = False,
) -> list[str]:
    """Each source's samples per epoch in a stopped and resumed run of a Mix against the
    uninterrupted run's, beyond what padding or ``drop_last`` can move: the reference's
    own (its samples more or fewer than ``sum(mix.counts)``) and the resumed run's, less
    than one global ``step`` (the larger one)."""
    want = _per_source(mix, _shifted([refs], False), epochs)
    have = _per_source(mix, _shifted(segments, later), epochs)
    n = int(sum(mix.counts))
    out = []
    for e in range(epochs):
        w, h = want[e], have[e]
        slack = abs(int(w.sum()) - n) + min(abs(int(h.sum()) - n), step - 1)
        off = [d for d in range(len(mix.names)) if abs(int(h[d]) - int(w[d])) > slack]
        if off:
            shown = ", ".join(
                f"{mix.names[d]!r} {int(h[d])} ({int(w[d])} uninterrupted)" for d in off
            )
            out.append(f"epoch {e}: samples per source {shown}")
    return out


def resume_findings(
    report: ResumeReport,
    refs: list[RankResult],
    codes: dict[int, np.ndarray],
    settings: Settings,
    label: Callable[[int], str],
) -> list[Finding]:
    """The ``resume`` finding and one per stop (``codes``: ``id(result)`` -> its ids'
    integer codes, one code space for every run; ``label`` names a code)."""

    def encode(result: RankResult) -> np.ndarray:
        return codes[id(result)]

    if report.cannot is not None:
        return [Finding("resume", "Resume", "WARN", 0, f"cannot resume: {report.cannot}")]
    ref = _run_of(refs, [encode(r) for r in refs], 0, settings.world_size)
    whole = ref  # with a packed dataset's pad rows: batch counts include them
    pack = refs[0].pack if refs else None
    # a Mix by samples is apportioned on world_size x batch_size steps: its order after
    # a resume onto another world size is another one by design (docs/mixtures.md)
    mix = refs[0].mix if refs and pack is None else None
    if pack is not None:  # pad rows hold no data (their count may differ on another topology)
        ref = ref.select(ref.ids >= 0)
    # what the uninterrupted run got wrong already is its own finding (``tokens``)
    unresumed = set() if pack is None else set(resumed_tokens(pack, [refs], settings.epochs))
    report.reference = ref
    findings: list[Finding] = []
    notes: list[str] = []
    for s in report.stops:
        status: Status = "PASS"
        if s.error is not None:
            status, detail = "WARN", s.error
        else:
            segs = [
                _run_of(
                    rs, [encode(r) for r in rs], k, settings.world_size if k == 0 else s.world_size
                )
                for k, rs in enumerate(s.segments)
            ]
            # every rank the same number of batches after each load (the rule the
            # uninterrupted run is held to: a rank with more blocks DDP)
            balance = balance_problems(whole, Run.concat(segs, s.world_size))
            if pack is not None:
                segs = [seg.select(seg.ids >= 0) for seg in segs]
            got = Run.concat(segs, s.world_size)
            s.run = got
            judge = functools.partial(
                check_stop,
                ref,
                batch_size=settings.batch_size,
                reproducible=prefix_matches(ref, segs[0]),
                label=label,
                topology_free=mix is None,
            )
            check = judge(got)
            later = False  # the passes after the load counted one epoch later
            if check.problems and s.stop.last and not s.stop.end_of_pass:
                # a state saved after an epoch's last batch may be the next epoch's start
                # (evenly's, litdata's): the loop's first pass after the load is that epoch
                shifted = _next_epoch(segs, s.stop, settings.epochs, s.world_size)
                other = judge(shifted)
                if not other.problems:
                    check = other
                    check.notes.append(
                        "the state saved after the epoch's last batch resumed at the next "
                        "epoch's start (the loop's first pass after the load was that epoch)"
                    )
                    got = s.run = shifted
                    later = True
            if pack is not None:  # packed: every token once, resumed too
                tokens = resumed_tokens(pack, s.segments, settings.epochs, later)
                check.problems += [t for t in tokens if t not in unresumed]
            moved = mix is not None and s.world_size != settings.world_size
            if mix is not None and moved:  # judged by exactly-once and each source's share
                step = max(s.world_size, settings.world_size) * settings.batch_size
                check.problems += resumed_shares(
                    mix, refs, s.segments, settings.epochs, step, later
                )
            check.problems += balance + s.length_errors
            if check.problems:
                status = "FAIL"
            elif check.notes:
                status = "WARN"
            where = f"onto {s.onto()}"
            if moved:
                where += (
                    " (a Mix's order depends on world_size x batch_size: judged by "
                    "exactly-once and samples per source, not by order)"
                )
            detail = "; ".join(check.problems + check.notes) or f"exact after resuming {where}"
        notes.extend(s.notes)
        findings.append(Finding(_slug(s.stop), f"Resume: {s.stop}", status, 0, detail))
    errors = [s.error for s in report.stops if s.error is not None]
    if not report.stops:
        head = Finding("resume", "Resume", "WARN", 0, "no batch to stop at")
    elif len(errors) == len(report.stops):
        head = Finding("resume", "Resume", "WARN", len(errors), f"at no stop: {errors[0]}")
    elif errors:
        head = Finding(
            "resume",
            "Resume",
            "WARN",
            len(errors),
            f"cannot resume at {len(errors)} of {len(report.stops)} stops: {errors[0]}",
        )
    elif notes:
        head = Finding("resume", "Resume", "WARN", len(notes), "; ".join(sorted(set(notes))))
    else:
        s0 = report.stops[0]
        head = Finding(
            "resume",
            "Resume",
            "PASS",
            0,
            f"{len(report.stops)} stops resumed onto {s0.onto()}",
        )
    return [head, *findings]
