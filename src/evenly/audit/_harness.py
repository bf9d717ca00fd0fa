"""The checkpoint harness (``evenly.testing.check_resume``): stop after every batch, resume
a fresh loader under another topology, and check the rest of the run against evenly's
plan with the resume checker's rules (``._resumecheck``, shared with ``evenly audit
--resume``).

:func:`check_resume` takes a factory of the loader under test (one :class:`Rig` per
simulated rank: evenly datasets take explicit ``rank=``/``world_size=``, so several ranks
run in one process; DataLoader workers are real processes) and two :class:`Layout` s.

(a) It runs an uninterrupted reference under ``before`` (every simulated rank, three
    epochs) and takes each rank's state after every batch of the first two epochs.
(b) For each stop ``t`` (every batch index over two epochs, so the epoch boundary too; or
    a few with ``every_batch=False``), it JSON round-trips rank 0's state after ``t``
    batches, builds FRESH loaders under ``after``, loads the state, finishes that epoch
    and runs the next one.
(c) It asserts, for every stop (an AssertionError names every problem of the first
    rule that fails): the samples delivered before (the reference's first batches) and
    after, over all ranks, are the epoch's multiset plus exactly the plan's padding
    (reported by the loader where it reports it, fewer than ``world_size`` repeats);
    the global order is the epoch's position-wise order (what one rank with
    ``world_size=1`` reads; for a source that plans its own order by the global step,
    the ``before`` run's, and only when ``after`` keeps its step); every rank gets the
    same number of batches, at most one of them partial; the following epoch is right.
    After all that, that ``len(loader)`` after the load is the batches the state says were
    received plus the batches actually left, and before every later pass the batches it
    then yields (:class:`LengthMismatch`), and that the state (evenly's part of it) has the
    same keys and shape at every stop (:class:`StateShapeChanged`).

For ``evenly.DataLoader(infinite=True)`` the stops are steps of one endless pass over
consecutive epochs, and the resumed loader runs until the end of the epoch after the one
it resumed in (:func:`check_resume` sees ``Rig.infinite``).

The factories at the end build rigs for evenly.DataLoader, a plain torch DataLoader over
evenly.Dataset, evenly.BatchSampler under torch's DataLoader and torchdata's
StatefulDataLoader (``pip install torchdata``).  Only public API is used: positions are
dealt as the documented :class:`evenly.core.EpochPlan` deals them.
"""

from __future__ import annotations

import gc
import warnings
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils.data as tud

from evenly.core import EpochPlan
from evenly.dataset import Dataset
from evenly.loader.loader import DataLoader
from evenly.loader.sampler import BatchSampler

from ._resumecheck import (
    batch_problems,
    count_problems,
    position_problems,
    round_trip,
    shape_of,
    stranger_problems,
    stream_problems,
    undeal,
)

__all__ = [
    "Layout",
    "LengthMismatch",
    "Make",
    "Report",
    "Rig",
    "StateShapeChanged",
    "check_resume",
    "evenly_loader",
    "sampler_loader",
    "stateful_loader",
    "torch_loader",
]

#: Epochs the reference runs: stops fall in the first two, the resumed run checks the next.
_EPOCHS = 3


@dataclass(frozen=True)
class Layout:
    """A topology: simulated ranks, DataLoader worker processes per rank, batch size."""

    world_size: int
    num_workers: int = 0
    batch_size: int = 4

    @property
    def step(self) -> int:
        """Samples all ranks receive together per batch index."""
        return self.world_size * self.batch_size

    def __str__(self) -> str:
        return f"{self.world_size} rank(s) x {self.num_workers} worker(s), batch {self.batch_size}"


class StateShapeChanged(AssertionError):
    """The state's keys or the types of its values differ between two stops."""


class LengthMismatch(AssertionError):
    """``len(loader)`` was not what the loader then yielded (after a load: the batches the
    state records as received plus the batches left; before an epoch: its batches)."""


#: torch's warning when a DataLoader yields more than ``len()`` said (a stale length)
_TORCH_LENGTH_WARNING = "Length of IterableDataset"


class _Findings:
    """Failures of ``len()`` and of the state's shape, raised after every other check (so
    that an expected one cannot hide another)."""

    def __init__(self) -> None:
        self.lengths: list[str] = []
        self.shapes: dict[Any, int] = {}

    def shape(self, rig: Rig, state: dict[str, Any], stop: int) -> None:
        self.shapes.setdefault(shape_of(rig.own_state(state)), stop)

    def states(
        self, rig: Rig, states: list[list[dict[str, Any]]], what: str, *, same: bool
    ) -> None:
        """The shape of every rank's state at every stop (``states``: rank -> the state
        after t batches); with ``same``, every rank's state is rank 0's."""
        for t, state in enumerate(states[0]):
            for rank, taken in enumerate(states):
                self.shape(rig, taken[t], t)
                if same and rank:
                    assert taken[t] == state, f"{what} {t}: rank {rank}'s state differs"

    def length(self, got: int | None, want: int, what: str) -> None:
        if got is not None and got != want:
            self.lengths.append(f"{what}: len(loader) {got}, {want} expected")

    def passes(
        self,
        rig: Rig,
        count: int,
        what: str,
        *,
        each: str = ", pass",
        first: bool = False,
        states: list[dict[str, Any]] | None = None,
    ) -> list[list[list[int]]]:
        """``count`` passes of ``rig``, each after asking ``len()`` (as a loop showing its
        progress does), which must be the batches the pass then yields (the first pass's
        only with ``first``: else its caller checks it); torch's stale-length warning is a
        length finding, the other warnings are warned again.  The state after each batch
        of every pass but the last is appended to ``states``, where given."""
        out = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for i in range(count):
                length = rig.length() if i or first else None
                batches = _take(rig, states=states if i < count - 1 else None)
                self.length(length, len(batches), f"{what}{each} {i}")
                out.append(batches)
        for w in caught:
            if _TORCH_LENGTH_WARNING in str(w.message):
                self.lengths.append(f"{what}: torch warned: {w.message}")
            else:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        return out

    def raise_any(self) -> None:
        problems: list[AssertionError] = []
        if self.lengths:
            shown = "; ".join(self.lengths[:4]) + (" ..." if len(self.lengths) > 4 else "")
            problems.append(LengthMismatch(f"{len(self.lengths)} wrong length(s): {shown}"))
        if len(self.shapes) > 1:
            problems.append(
                StateShapeChanged(
                    "the state's shape changed between stops: "
                    + "; ".join(f"from stop {stop}: {shape}" for shape, stop in self.shapes.items())
                )
            )
        if len(problems) > 1:
            raise AssertionError("; ".join(f"{type(p).__name__}: {p}" for p in problems))
        if problems:
            raise problems[0]


def to_ids(batch: Any) -> list[int]:
    """A batch of integer samples as a list of ints (a tensor, or a list of numbers)."""
    if isinstance(batch, torch.Tensor):
        return [int(x) for x in batch.reshape(-1).tolist()]
    return [int(x) for x in batch]


class Rig(ABC):
    """One simulated rank's loader as the harness drives it: iterating it is one pass (one
    epoch, or for an infinite loader an endless stream) of this rank's batches as sample
    ids, and it counts what the loop received, as a training loop would.

    Subclasses say how the plan deals samples (``plan_batch``), whether the rank's samples
    arrive in the order of its plan positions (``in_order``), and how the loader saves,
    loads and reports its length and padding.
    """

    #: Samples the plan deals to a rank at a time: the batch size when evenly plans whole
    #: batches (evenly.DataLoader, evenly.BatchSampler), 1 when evenly.Dataset owns the
    #: pass under another loader (it yields single samples).
    plan_batch: int
    #: The rank's samples arrive in the order of its plan positions (False when several
    #: workers batch their own shares of a dataset-owned pass).
    in_order: bool = True
    #: One endless pass over consecutive epochs (evenly.DataLoader(infinite=True)).
    infinite: bool = False
    #: Every rank's state is the same after the same number of batches (save rank 0's).
    rank_free_state: bool = True
    #: The state records the batches this rank had received in the interrupted epoch.
    records_batches: bool = True
    #: A state taken after an epoch's last batch resumes that finished epoch: the next
    #: pass is empty, then the next epoch follows (torchdata's convention; evenly's
    #: states point at the next epoch instead).
    resumes_finished_epoch: bool = False

    def __init__(self) -> None:
        self.batches_received = 0
        self.samples_received = 0

    def __iter__(self) -> Iterator[list[int]]:
        self.batches_received = self.samples_received = 0
        for batch in self._batches():
            ids = to_ids(batch)
            self.batches_received += 1
            self.samples_received += len(ids)
            yield ids

    @abstractmethod
    def _batches(self) -> Iterator[Any]:
        """The loader's next pass."""

    @abstractmethod
    def state(self) -> dict[str, Any]:
        """The state after what the loop received so far."""

    @abstractmethod
    def load(self, state: dict[str, Any]) -> None:
        """Load a state into this (fresh) loader."""

    @abstractmethod
    def length(self) -> int | None:
        """``len(loader)`` now (None where it is undefined: an infinite loader)."""

    def remaining(self) -> int | None:
        """The batches the loader says the next pass yields, where it says it."""
        return None

    def padding(self) -> int | None:
        """The padding the loader reports for its next pass, where it reports it."""
        return None

    def recorded(self, state: dict[str, Any]) -> int:
        """The batches ``state`` says this rank had received in the interrupted epoch."""
        return int(state["batches"])

    def position(self, state: dict[str, Any]) -> tuple[int, int] | None:
        """(epoch, position) ``state`` resumes from, where the state says it."""
        return int(state["epoch"]), int(state["position"])

    def own_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """The part of ``state`` evenly makes (whose shape must not change)."""
        return state


#: A loader factory: (rank, layout) -> that rank's rig.
Make = Callable[[int, Layout], Rig]


@dataclass
class Report:
    """What a run of the harness checked."""

    #: The stops resumed from: batches (steps, for an infinite loader) of the reference.
    stops: list[int] = field(default_factory=list)
    #: Batches per rank of each reference epoch (empty for an infinite loader).
    batches_per_epoch: list[int] = field(default_factory=list)
    #: The state's shape (the same at every stop).
    shape: Any = None


# ---- the rules, as assertions ------------------------------------------------------------
def _require(problems: list[str]) -> None:
    """Raise AssertionError naming every problem, if any."""
    if problems:
        raise AssertionError("; ".join(problems))


def _undeal(
    per_rank: Sequence[Sequence[list[int]]],
    num_samples: int,
    world_size: int,
    plan_batch: int,
    start: int,
    complete: bool,
    what: str,
) -> dict[int, int]:
    """Plan position -> sample, from each rank's batches of a pass from ``start``
    (``complete``: the whole pass; else a prefix of it)."""
    plan = EpochPlan(
        num_samples=num_samples, world_size=world_size, batch_size=plan_batch, start=start
    )
    got, problems = undeal(per_rank, plan, complete=complete, what=what)
    _require(problems)
    return got


def _assert_multiset(got: Sequence[int], epoch: Sequence[int], padding: int, what: str) -> None:
    """``got`` is the epoch's samples, each once, plus exactly ``padding`` repeats."""
    _require(
        count_problems(got, epoch, pads=padding, what=what)
        + stranger_problems(got, epoch, what=what)
    )


def _assert_full_batches(
    per_rank: Sequence[Sequence[list[int]]], batch: int | None, what: str
) -> None:
    """Equal batch counts on every rank, and (given the batch size) at most one partial
    batch per rank, the last."""
    _require(batch_problems([[len(b) for b in r] for r in per_rank], batch, what=what))


def _assert_epoch(
    per_rank: Sequence[Sequence[list[int]]],
    order: Sequence[int],
    layout: Layout,
    plan_batch: int,
    in_order: bool,
    positions: bool,
    what: str,
) -> None:
    """A whole epoch from its start under ``layout``: the epoch's samples plus exactly the
    plan's padding, full batches (checked by size when ``in_order``), and (``positions``)
    every plan position holding ``order``'s sample."""
    n = len(order)
    plan = EpochPlan(num_samples=n, world_size=layout.world_size, batch_size=plan_batch)
    _assert_multiset([x for r in per_rank for b in r for x in b], order, plan.num_padded, what)
    _assert_full_batches(per_rank, layout.batch_size if in_order else None, what)
    if positions:
        got = _undeal(per_rank, n, layout.world_size, plan_batch, 0, True, what)
        _require(position_problems(got, order, what=what))


def _take(
    rig: Rig, count: int | None = None, states: list[dict[str, Any]] | None = None
) -> list[list[int]]:
    """One pass of ``rig``, or its first ``count`` batches; each batch's state, as a
    checkpoint file gives it back, is appended to ``states`` (but the ``count``-th's)."""
    batches = []
    for ids in rig:
        batches.append(ids)
        if len(batches) == count:
            break
        if states is not None:
            states.append(round_trip(rig.state()))
    return batches


def _settle() -> None:
    """Drop the workers of loaders that are gone (persistent ones too)."""
    gc.collect()


def _loaded(
    make: Make, after: Layout, state: dict[str, Any], want: tuple[int, int | None], where: str
) -> list[Rig]:
    """Fresh loaders under ``after`` with ``state`` (as a checkpoint file gives it back)
    loaded, after checking the (epoch, position) it says it resumes from."""
    fresh = [make(r, after) for r in range(after.world_size)]
    for rig in fresh:
        rig.load(round_trip(state))
    position = fresh[0].position(state)
    assert position is None or position == want, (
        f"{where}: the state resumes (epoch, position) {position}, not {want}"
    )
    return fresh


# ---- the harness --------------------------------------------------------------------------
def check_resume(
    make: Make,
    before: Layout,
    after: Layout,
    *,
    num_samples: int,
    every_batch: bool = True,
    topology_free: bool = True,
    samples: Collection[int] | None = None,
) -> Report:
    """Resume ``make``'s loader, saved under ``before``, under ``after`` at every stop.

    Raises AssertionError at the first wrong sample, order, batch count or padding; after
    every other check, :class:`LengthMismatch` if ``len(loader)`` was wrong somewhere and
    :class:`StateShapeChanged` if the state's shape changed (a plain AssertionError naming
    both if both).

    Args:
        make: (rank, layout) -> that rank's :class:`Rig`, a fresh loader each call.
        before: the topology the state is saved under.
        after: the topology it is loaded in.
        num_samples: samples per epoch (the source's length; a Mix's ``len``).
        every_batch: stop at every batch (for ``num_workers=0`` and small epochs); else at
            the first, middle and last batch of the first epoch, at the epoch boundary and
            at the last batch of the second epoch.
        topology_free: the epoch's order does not depend on the topology (not so for a
            Mix, whose order is laid out per global step): the reference order is what
            one rank with ``world_size=1`` reads, and the order is checked under any
            ``after``; otherwise the order of the ``before`` run, checked only when
            ``after`` keeps the global step.
        samples: the samples of every epoch, if known (each epoch must be a permutation).

    The source must be shuffled, so that a replayed epoch cannot pass for the next one.
    """
    probe = make(0, before)
    plan_batch, in_order = probe.plan_batch, probe.in_order
    rank_free, infinite = probe.rank_free_state, probe.infinite
    if infinite:
        return _check_stream(make, before, after, num_samples, every_batch, samples)
    _settle()
    report, findings = Report(), _Findings()

    # (a) the uninterrupted reference: every rank, three epochs, the state after each batch
    ref: list[list[list[list[int]]]] = [[] for _ in range(_EPOCHS)]  # epoch -> rank -> batches
    states: list[list[dict[str, Any]]] = []  # rank -> the state after t batches
    for rank in range(before.world_size):
        rig = make(rank, before)
        taken = [round_trip(rig.state())]
        what = f"reference rank {rank}"
        passes = findings.passes(rig, _EPOCHS, what, each=" epoch", first=True, states=taken)
        for e, batches in enumerate(passes):
            ref[e].append(batches)
        states.append(taken)
        del rig
    _settle()
    per_epoch = [len(ref[e][0]) for e in range(_EPOCHS)]
    report.batches_per_epoch = per_epoch
    findings.states(probe, states, "stop", same=rank_free)

    # the epochs' position-wise orders
    if topology_free:
        single = make(0, Layout(1, 0, before.batch_size))
        orders = [[x for b in single for x in b] for _ in range(_EPOCHS)]
        del single
    else:
        assert in_order, "a topology-dependent order needs a loader that delivers in order"
        orders = []
        for e in range(_EPOCHS):
            got = _undeal(ref[e], num_samples, before.world_size, plan_batch, 0, True, f"epoch {e}")
            orders.append([got[p] for p in range(num_samples)])
    for e, order in enumerate(orders):
        assert len(order) == num_samples, (e, len(order))
        if samples is not None:
            assert Counter(order) == Counter(samples), f"epoch {e} is not every sample once"
        what = f"reference epoch {e} under {before}"
        _assert_epoch(ref[e], order, before, plan_batch, in_order, in_order and topology_free, what)
    # a shuffled source: so that replaying an epoch cannot pass for the next one
    assert orders[0] != orders[1], "the epochs have the same order"

    # (b) + (c): resume at every stop
    total = per_epoch[0] + per_epoch[1]
    if every_batch:
        stops = list(range(total))
    else:
        stops = sorted({0, per_epoch[0] // 2, per_epoch[0] - 1, per_epoch[0], total - 1})
    report.stops = stops
    after_probe = make(0, after)
    after_plan_batch, records = after_probe.plan_batch, after_probe.records_batches
    finished_rest = after_probe.resumes_finished_epoch
    after_in_order = in_order and after_probe.in_order
    del after_probe
    # a Mix lays its order out per global step: comparable only if the step is kept
    same_step = after.world_size * after_plan_batch == before.world_size * plan_batch
    order_defined = after_in_order and (topology_free or same_step)
    for t in stops:
        epoch, done = (0, t) if t < per_epoch[0] else (1, t - per_epoch[0])
        where = f"stop {t} (epoch {epoch}, {done} batch(es) received) under {before} -> {after}"
        state = states[0][t]
        # what the ranks received is a prefix of the epoch's order (the batches before the
        # stop are full), unless several workers batched their own shares: then the state
        # resumes worker by worker, with the epoch's plan
        start = done * before.batch_size * before.world_size if in_order else None
        fresh = _loaded(make, after, state, (epoch, start), where)
        plan = EpochPlan(
            num_samples=num_samples,
            world_size=after.world_size,
            batch_size=after_plan_batch,
            start=start or 0,
        )
        nxt = EpochPlan(
            num_samples=num_samples, world_size=after.world_size, batch_size=after_plan_batch
        )
        lengths = [rig.length() for rig in fresh]
        remaining = [rig.remaining() for rig in fresh]
        paddings = [rig.padding() for rig in fresh]
        recorded = [rig.recorded(state) for rig in fresh]
        findings.shape(fresh[0], round_trip(fresh[0].state()), t)
        # after an epoch's last batch, a loader that resumes the finished epoch (torchdata's
        # convention) first yields its empty rest; evenly's loaders go on with the next one
        rest = t == per_epoch[0] and finished_rest
        resumed, following = [], []
        for rank, rig in enumerate(fresh):
            passes = findings.passes(rig, 3 if rest else 2, f"{where}: rank {rank}")
            if rest:
                assert passes[0] == [], f"{where}: rank {rank}: the finished epoch's rest"
                findings.length(lengths[rank], recorded[rank], f"{where}: rank {rank}")
                if records and recorded[rank] != per_epoch[0]:
                    findings.lengths.append(f"{where}: the state records {recorded[rank]}")
                lengths[rank] = None  # checked
            resumed.append(passes[-2])
            following.append(passes[-1])
        del fresh, rig
        if after.num_workers:
            _settle()

        for rank, batches in enumerate(resumed):
            # len(loader) after the load: the batches the state records + the batches left
            if records and not rest and recorded[rank] != done:
                findings.lengths.append(
                    f"{where}: rank {rank}: the state records {recorded[rank]} batch(es)"
                )
            findings.length(
                lengths[rank], recorded[rank] + len(batches), f"{where}: rank {rank} after the load"
            )
            if remaining[rank] is not None:
                assert remaining[rank] == len(batches), (
                    f"{where}: rank {rank}: remaining_batches {remaining[rank]}, "
                    f"{len(batches)} yielded"
                )
            if paddings[rank] is not None:
                assert paddings[rank] == plan.num_padded, (
                    f"{where}: rank {rank}: reports {paddings[rank]} pad(s), the plan from "
                    f"position {start} has {plan.num_padded}"
                )
            got_samples = sum(len(b) for b in batches)
            if start is not None:
                assert got_samples == plan.samples_per_rank, (
                    f"{where}: rank {rank} got {got_samples} samples, the plan from position "
                    f"{start} deals it {plan.samples_per_rank}"
                )
            got_samples = sum(len(b) for b in following[rank])
            assert got_samples == nxt.samples_per_rank, (
                f"{where}: rank {rank} got {got_samples} samples in the following epoch, "
                f"the plan deals it {nxt.samples_per_rank}"
            )

        # the interrupted epoch: before + after, over all ranks
        before_ids = [x for r in ref[epoch] for b in r[:done] for x in b]
        after_ids = [x for r in resumed for b in r for x in b]
        assert plan.num_padded < after.world_size or plan.num_padded == 0
        _assert_multiset(before_ids + after_ids, orders[epoch], plan.num_padded, where)
        _assert_full_batches(resumed, after.batch_size if after_in_order else None, where)
        if order_defined and start is not None:
            head = [r[:done] for r in ref[epoch]]
            got = _undeal(head, num_samples, before.world_size, plan_batch, 0, False, where)
            assert all(p < start for p in got), where
            tail = _undeal(
                resumed, num_samples, after.world_size, after_plan_batch, start, True, where
            )
            _require(position_problems({**got, **tail}, orders[epoch], what=where))

        # the following epoch, from its start
        what = f"{where}: the following epoch {epoch + 1}"
        _assert_epoch(
            following,
            orders[epoch + 1],
            after,
            after_plan_batch,
            after_in_order,
            order_defined,
            what,
        )

    findings.raise_any()
    report.shape = next(iter(findings.shapes))
    return report


def _stream_positions(
    per_rank: Sequence[Sequence[list[int]]], layout: Layout, start: int, count: int, what: str
) -> dict[int, int]:
    """Stream position -> sample, from ``count`` full batches per rank of ``layout`` from
    stream position ``start`` (one global step after the other)."""
    for r, batches in enumerate(per_rank):
        assert len(batches) == count and all(len(b) == layout.batch_size for b in batches), (
            f"{what}: rank {r}: batch sizes {[len(b) for b in batches]}"
        )
    return {
        start + s * layout.step + r * layout.batch_size + i: x
        for r, batches in enumerate(per_rank)
        for s, b in enumerate(batches)
        for i, x in enumerate(b)
    }


def _check_stream(
    make: Make,
    before: Layout,
    after: Layout,
    num_samples: int,
    every_batch: bool,
    samples: Collection[int] | None,
) -> Report:
    """:func:`check_resume` for an infinite loader: stops are steps of one endless pass."""
    probe = make(0, before)
    _settle()
    report, findings = Report(), _Findings()
    n = num_samples
    steps = -(-2 * n // before.step)  # two epochs, so stops cross an epoch boundary
    ref: list[list[list[int]]] = []  # rank -> batches
    states: list[list[dict[str, Any]]] = []
    for rank in range(before.world_size):
        rig = make(rank, before)
        taken = [round_trip(rig.state())]
        ref.append(_take(rig, steps, taken))
        states.append(taken)
        del rig
    _settle()
    findings.states(probe, states, "step", same=True)

    stops = list(range(steps)) if every_batch else sorted({0, steps // 2, steps - 1})
    report.stops = stops
    # how far each resumed run goes: to the end of the epoch after the one it resumes in
    targets = {t: (t * before.step // n + 2) * n for t in stops}
    length = max(targets.values()) + after.step + before.step
    single = make(0, Layout(1, 0, before.batch_size))
    stream: list[int] = []
    for ids in single:
        stream += ids
        if len(stream) >= length:
            break
    del single
    for e in range(len(stream) // n):
        if samples is not None:
            chunk = stream[e * n : (e + 1) * n]
            assert Counter(chunk) == Counter(samples), f"epoch {e} of the stream"
    # a shuffled source: so that replaying an epoch cannot pass for the next one
    assert stream[:n] != stream[n : 2 * n], "the epochs have the same order"

    def check(got: dict[int, int], upto: int, what: str) -> None:
        _require(stream_problems(got, stream, upto, what=what))

    ref_got = _stream_positions(ref, before, 0, steps, f"reference under {before}")
    check(ref_got, steps * before.step, f"reference under {before}")

    for t in stops:
        start = t * before.step
        where = f"step {t} (stream position {start}) under {before} -> {after}"
        state = states[0][t]
        fresh = _loaded(make, after, state, divmod(start, n), where)
        for rig in fresh:
            if rig.length() is not None:
                findings.lengths.append(f"{where}: an infinite loader has len() {rig.length()}")
        findings.shape(fresh[0], round_trip(fresh[0].state()), t)
        count = -(-(targets[t] - start) // after.step)
        resumed = [_take(rig, count) for rig in fresh]
        del fresh, rig
        if after.num_workers:
            _settle()
        got = {p: x for p, x in ref_got.items() if p < start}
        got.update(_stream_positions(resumed, after, start, count, where))
        check(got, start + count * after.step, where)
    findings.raise_any()
    report.shape = next(iter(findings.shapes))
    return report


# ---- rigs ---------------------------------------------------------------------------------
def _loader_kwargs(layout: Layout) -> dict[str, Any]:
    # a guard against a hang: a test that hangs fails with "timed out" instead
    return {"num_workers": layout.num_workers, "timeout": 60 if layout.num_workers else 0}


class _LoaderRig(Rig):
    """A rig over a loader: its passes, and by default its own state and ``len()``."""

    def __init__(self, loader: Any) -> None:
        super().__init__()
        self.loader = loader

    def _batches(self) -> Iterator[Any]:
        return iter(self.loader)

    def state(self) -> dict[str, Any]:
        state: dict[str, Any] = self.loader.state_dict()
        return state

    def load(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)

    def length(self) -> int | None:
        return len(self.loader)


class EvenlyLoaderRig(_LoaderRig):
    """``evenly.DataLoader``: its own state, length and plan."""

    def __init__(self, loader: DataLoader) -> None:
        super().__init__(loader)
        self.plan_batch = int(loader.batch_size or 1)
        self.infinite = loader.infinite

    def length(self) -> int | None:
        try:
            return len(self.loader)
        except TypeError:
            if self.infinite:
                return None
            raise

    def remaining(self) -> int | None:
        return None if self.infinite else self.loader.remaining_batches  # type: ignore[no-any-return]

    def padding(self) -> int | None:
        return None if self.infinite else self.loader.plan.num_padded  # type: ignore[no-any-return]


class TorchLoaderRig(_LoaderRig):
    """A plain torch DataLoader over ``evenly.Dataset``: the dataset owns the pass, and is
    told what the loop received (``state_dict(samples_received=...)``)."""

    plan_batch = 1
    #: the dataset cannot know the torch loader's batches: its state records none
    records_batches = False

    def __init__(self, dataset: Dataset[Any], loader: tud.DataLoader[Any]) -> None:
        super().__init__(loader)
        self.dataset = dataset
        self.in_order = loader.num_workers == 0

    def state(self) -> dict[str, Any]:
        return self.dataset.state_dict(samples_received=self.samples_received)

    def load(self, state: dict[str, Any]) -> None:
        self.dataset.load_state_dict(state)

    def padding(self) -> int | None:
        return self.dataset.plan().num_padded


class SamplerRig(_LoaderRig):
    """``evenly.BatchSampler`` under torch's DataLoader over a map-style dataset, told what
    the loop received (``state_dict(batches_received=...)``)."""

    def __init__(self, sampler: BatchSampler, loader: tud.DataLoader[Any]) -> None:
        super().__init__(loader)
        self.sampler = sampler
        self.plan_batch = sampler.batch_size

    def state(self) -> dict[str, Any]:
        return self.sampler.state_dict(batches_received=self.batches_received)

    def load(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)

    def remaining(self) -> int | None:
        return self.sampler.remaining_batches

    def padding(self) -> int | None:
        return self.sampler.plan.num_padded


class StatefulRig(_LoaderRig):
    """torchdata's ``StatefulDataLoader`` over ``evenly.Dataset``: the loader's own state
    (torchdata's format, with evenly's states inside)."""

    plan_batch = 1
    resumes_finished_epoch = True

    def __init__(self, loader: Any) -> None:
        super().__init__(loader)
        workers = int(loader.num_workers)
        self.in_order = workers == 0
        # with workers the state holds each worker's progress and a per-rank base seed
        self.rank_free_state = workers == 0

    def recorded(self, state: dict[str, Any]) -> int:
        if "_num_yielded" in state:
            return int(state["_num_yielded"])
        return int(state["_snapshot"]["_snapshot_step"])

    def position(self, state: dict[str, Any]) -> tuple[int, int] | None:
        inner = state.get("dataset_state")
        if not isinstance(inner, dict):
            return None  # per-worker states
        return int(inner["epoch"]), int(inner["position"])

    def own_state(self, state: dict[str, Any]) -> dict[str, Any]:
        # torchdata's own fields are not evenly's (``_IterableDataset_len_called`` turns
        # from None into an int once len() is asked): evenly's states inside them
        if "dataset_state" in state:
            return {"dataset_state": state["dataset_state"]}
        workers = state["_snapshot"]["_worker_snapshots"]
        return {name: w["dataset_state"] for name, w in workers.items()}


# ---- factories ----------------------------------------------------------------------------
def _dataset(
    source: Callable[[], Any], rank: int, layout: Layout, kwargs: dict[str, Any]
) -> Dataset[Any]:
    """``evenly.Dataset(source(), ...)`` as simulated rank ``rank`` of ``layout``."""
    return Dataset(source(), rank=rank, world_size=layout.world_size, **kwargs)


def evenly_loader(
    source: Callable[[], Any],
    *,
    infinite: bool = False,
    worker_type: str = "auto",
    **dataset_kwargs: Any,
) -> Make:
    """``evenly.DataLoader`` over ``evenly.Dataset(source(), ...)`` (its workers of
    ``worker_type``)."""

    def make(rank: int, layout: Layout) -> Rig:
        ds = _dataset(source, rank, layout, dataset_kwargs)
        loader = DataLoader(
            ds,
            batch_size=layout.batch_size,
            infinite=infinite,
            worker_type=worker_type,  # type: ignore[arg-type]
            **_loader_kwargs(layout),
        )
        return EvenlyLoaderRig(loader)

    return make


def torch_loader(source: Callable[[], Any], **dataset_kwargs: Any) -> Make:
    """A plain ``torch.utils.data.DataLoader`` over ``evenly.Dataset(source(), ...)``."""

    def make(rank: int, layout: Layout) -> Rig:
        ds = _dataset(source, rank, layout, dataset_kwargs)
        loader = tud.DataLoader(ds, batch_size=layout.batch_size, **_loader_kwargs(layout))
        return TorchLoaderRig(ds, loader)

    return make


def sampler_loader(num_samples: int, **sampler_kwargs: Any) -> Make:
    """``evenly.BatchSampler`` under torch's DataLoader over the map-style samples
    ``0 .. num_samples - 1``."""

    def make(rank: int, layout: Layout) -> Rig:
        sampler = BatchSampler(
            num_samples,
            layout.batch_size,
            rank=rank,
            world_size=layout.world_size,
            **sampler_kwargs,
        )
        data: Any = list(range(num_samples))  # map-style: sample i is i
        loader: tud.DataLoader[Any] = tud.DataLoader(
            data, batch_sampler=sampler, **_loader_kwargs(layout)
        )
        return SamplerRig(sampler, loader)

    return make


def stateful_loader(source: Callable[[], Any], **dataset_kwargs: Any) -> Make:
    """torchdata's ``StatefulDataLoader`` over ``evenly.Dataset(source(), ...)``."""

    def make(rank: int, layout: Layout) -> Rig:
        from torchdata.stateful_dataloader import StatefulDataLoader  # type: ignore[import-untyped]

        ds = _dataset(source, rank, layout, dataset_kwargs)
        loader = StatefulDataLoader(ds, batch_size=layout.batch_size, **_loader_kwargs(layout))
        return StatefulRig(loader)

    return make
