"""Pure comparisons of a resumed run with the uninterrupted one (numpy only).

A ``Run`` is every delivered sample of one way through the epochs, as columns: the
uninterrupted reference, or a run that stopped, saved, and went on in fresh processes
(``seg`` 0 before the stop, 1 after the load, 2 after a second load).  ``check_stop``
judges one stop: per epoch, the samples missing and the ones repeated (against the
reference's own counts: its padding stays allowed; under another world size the padding
may differ, by less than one global batch), and the order: on the same topology each
rank's sequence, on another one the global order (epoch, batch, rank, position), where
a repeat counts at its first delivery (under another world size up to the epoch's last
global step, which may be dealt otherwise).  An epoch that delivers another epoch's order is
named as such ("wrong epoch").  An order that depends on the topology by design (an
``evenly.Mix`` by samples: its apportionment is laid out on ``world_size x batch_size``
steps) is not compared after a resume onto another world size (``topology_free=False``):
there only what was delivered is judged.  When the run before the stop does not match the
reference, the loader is not reproducible between runs and orders are not compared.

The rules a resumed run is held to are pure functions here, shared by the audit (which
knows only the uninterrupted run) and the checkpoint harness (``evenly.testing.
check_resume``, which also knows evenly's plan): ``count_problems`` (missing, repeated
beyond the padding), ``stranger_problems`` (samples of no epoch), ``batch_problems``
(equal batches per rank, at most one partial, the last), ``undeal`` and
``position_problems`` (each plan position holds the order's sample), ``balance_problems``
(``batch_problems`` on each run after a load: the audit's), ``stream_problems``
(an endless stream, position by position); ``shape_of`` and ``round_trip`` for states.

>>> import numpy as np
>>> ref = Run.of(ids=[0, 1, 2, 3], rank=[0, 0, 0, 0], epoch=[0, 0, 0, 0],
...              batch=[0, 0, 1, 1], pos=[0, 1, 0, 1], seg=[0, 0, 0, 0], world_size=1)
>>> got = Run.of(ids=[0, 1, 0, 1], rank=[0, 0, 0, 0], epoch=[0, 0, 0, 0],
...              batch=[0, 0, 1, 1], pos=[0, 1, 0, 1], seg=[0, 0, 1, 1], world_size=1)
>>> check_stop(ref, got, batch_size=2).problems
['epoch 0: 2 missing (e.g. 2, 3)', 'epoch 0: 2 repeated (e.g. 0, 1)']
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from evenly.core import EpochPlan

from ._types import I64

__all__ = [
    "Run",
    "StopCheck",
    "balance_problems",
    "batch_problems",
    "check_stop",
    "count_problems",
    "first_occurrences",
    "position_problems",
    "prefix_matches",
    "round_trip",
    "shape_of",
    "stranger_problems",
    "stream_problems",
    "undeal",
]

#: Ids shown per problem.
SHOWN = 5


def shape_of(value: Any) -> Any:
    """A state's shape: its keys, recursively, and the JSON type of every value (lists
    by type only: their length may change).

    >>> shape_of({"epoch": 1, "workers": [1, 2], "pad": {"mode": "repeat"}})
    (('epoch', 'int'), ('pad', (('mode', 'str'),)), ('workers', 'list'))
    """
    if isinstance(value, dict):
        return tuple(sorted((str(k), shape_of(v)) for k, v in value.items()))
    if isinstance(value, list | tuple):
        return "list"
    return type(value).__name__


def round_trip(state: dict[str, Any]) -> dict[str, Any]:
    """The state as a JSON checkpoint file gives it back.

    >>> round_trip({"epoch": (1, 2)})
    {'epoch': [1, 2]}
    """
    restored: dict[str, Any] = json.loads(json.dumps(state))
    return restored


@dataclass(frozen=True)
class Run:
    """Delivered samples as columns (ids are integer codes)."""

    ids: I64
    rank: I64
    epoch: I64
    batch: I64
    pos: I64
    seg: I64
    world_size: int

    @classmethod
    def of(cls, world_size: int, **cols: Sequence[int] | I64) -> Run:
        arrays = {k: np.asarray(v, dtype=np.int64) for k, v in cols.items()}
        return cls(world_size=world_size, **arrays)

    @classmethod
    def concat(cls, runs: Sequence[Run], world_size: int) -> Run:
        names = ("ids", "rank", "epoch", "batch", "pos", "seg")
        cols = {n: np.concatenate([getattr(r, n) for r in runs]) for n in names}
        return cls(world_size=world_size, **cols)

    def select(self, rows: Any) -> Run:
        """The rows where the boolean mask ``rows`` is true."""
        names = ("ids", "rank", "epoch", "batch", "pos", "seg")
        return Run(world_size=self.world_size, **{n: getattr(self, n)[rows] for n in names})

    def epochs(self) -> list[int]:
        return sorted({int(e) for e in np.unique(self.epoch)})

    def global_order(self, epoch: int) -> I64:
        """The epoch's ids as a DDP step sees them: (seg, batch, rank, position)."""
        rows = np.flatnonzero(self.epoch == epoch)
        key = np.lexsort((self.pos[rows], self.rank[rows], self.batch[rows], self.seg[rows]))
        out: I64 = self.ids[rows[key]]
        return out

    def rank_order(self, epoch: int, rank: int) -> I64:
        """The epoch's ids as ``rank`` received them (rows are in delivery order per seg)."""
        rows = np.flatnonzero((self.epoch == epoch) & (self.rank == rank))
        out: I64 = self.ids[rows[np.argsort(self.seg[rows], kind="stable")]]
        return out


def first_occurrences(seq: I64) -> I64:
    """``seq`` with every repeat after its first delivery removed.

    >>> first_occurrences(np.array([3, 1, 3, 2, 1])).tolist()
    [3, 1, 2]
    """
    _, idx = np.unique(seq, return_index=True)
    out: I64 = seq[np.sort(idx)]
    return out


@dataclass
class StopCheck:
    """What one stop's comparison found: defects, and notes (what could not be compared)."""

    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _show(codes: I64, label: Callable[[int], str]) -> str:
    shown = ", ".join(label(int(c)) for c in codes[:SHOWN])
    return f"e.g. {shown}" + (", ..." if len(codes) > SHOWN else "")


def _counts(ids: I64, values: I64) -> I64:
    uniq, counts = np.unique(ids, return_counts=True)
    at = np.searchsorted(uniq, values)
    hit = (at < len(uniq)) & (uniq[np.minimum(at, len(uniq) - 1)] == values)
    out: I64 = np.where(hit, counts[np.minimum(at, len(uniq) - 1)], 0).astype(np.int64)
    return out


def count_problems(
    have: Sequence[int] | I64,
    want: Sequence[int] | I64,
    *,
    pads: int | tuple[int, int] = 0,
    label: Callable[[int], str] = str,
    what: str,
) -> list[str]:
    """``have`` against ``want`` by counts: the samples of ``want`` never delivered, and
    the deliveries beyond ``want``'s counts (repeats; samples not in ``want`` count too),
    which must number exactly ``pads`` (the padding the plan adds) or, given a range
    (lo, hi), within it (the padding a new topology may need).

    >>> count_problems([0, 1, 1, 1], [0, 1, 2], what="epoch 0")
    ['epoch 0: 1 missing (e.g. 2)', 'epoch 0: 2 repeated (e.g. 1, 1)']
    >>> count_problems([0, 1, 2], [0, 1, 2], pads=1, what="epoch 0")
    ['epoch 0: 0 repeated, the plan pads 1']
    >>> count_problems([0, 1, 2, 0], [0, 1, 2], pads=(0, 2), what="epoch 0")
    []
    """
    have_a = np.asarray(have, dtype=np.int64)
    want_a = np.asarray(want, dtype=np.int64)
    values = np.unique(np.concatenate([want_a, have_a]))
    w, h = _counts(want_a, values), _counts(have_a, values)
    out = []
    missing = values[(h == 0) & (w > 0)]
    if len(missing):
        out.append(f"{what}: {len(missing)} missing ({_show(missing, label)})")
    extra = np.maximum(h - w, 0)
    count = int(extra.sum())
    if isinstance(pads, tuple):
        lo, hi = pads
        why = f", beyond the {hi} a new padding may need"
    else:
        lo = hi = pads
        why = f", the plan pads {pads}" if pads else ""
    if not lo <= count <= hi:
        shown = f" ({_show(np.repeat(values, extra), label)})" if count else ""
        out.append(f"{what}: {count} repeated{shown}{why}")
    return out


def stranger_problems(
    have: Sequence[int] | I64,
    want: Sequence[int] | I64,
    *,
    label: Callable[[int], str] = str,
    what: str,
) -> list[str]:
    """Samples delivered that are not in ``want`` at all (a pad is a repeat, never a
    stranger).

    >>> stranger_problems([0, 1, 7], [0, 1, 2], what="epoch 0")
    ['epoch 0: 1 not in the epoch (e.g. 7)']
    """
    have_a = np.asarray(have, dtype=np.int64)
    strangers = np.setdiff1d(have_a, np.asarray(want, dtype=np.int64))
    if not len(strangers):
        return []
    return [f"{what}: {len(strangers)} not in the epoch ({_show(strangers, label)})"]


def batch_problems(
    sizes: Sequence[Sequence[int]], batch_size: int | None, *, what: str
) -> list[str]:
    """Batch sizes per rank (``sizes[rank]``): every rank the same number of batches (a
    rank with more blocks DDP), and, given ``batch_size``, at most one partial batch per
    rank, its last.

    >>> batch_problems([[4, 4, 1], [4, 4]], 4, what="epoch 0")
    ['epoch 0: batches per rank [3, 2] (DDP hang risk)']
    >>> batch_problems([[4, 1, 4]], 4, what="epoch 0")
    ['epoch 0: rank 0 batch sizes [4, 1, 4]']
    """
    counts = [len(r) for r in sizes]
    out = []
    if len(set(counts)) > 1:
        out.append(f"{what}: batches per rank {counts} (DDP hang risk)")
    if batch_size is not None:
        for rank, rank_sizes in enumerate(sizes):
            if any(s != batch_size for s in rank_sizes[:-1]):
                out.append(f"{what}: rank {rank} batch sizes {list(rank_sizes)}")
    return out


def balance_problems(ref: Run, got: Run) -> list[str]:
    """``batch_problems`` (batch counts) on each part of ``got`` after a load (seg >= 1),
    per epoch: every rank of the resumed topology the same number of batches, in the
    epochs where the uninterrupted run had that (else that is its own finding).

    >>> ref = Run.of(ids=[0, 1, 2, 3], rank=[0, 1, 0, 1], epoch=[0] * 4, batch=[0, 0, 1, 1],
    ...              pos=[0] * 4, seg=[0] * 4, world_size=2)
    >>> got = Run.of(ids=[0, 1, 2, 3, 3], rank=[0, 1, 0, 1, 1], epoch=[0] * 5,
    ...              batch=[0, 0, 1, 1, 2], pos=[0] * 5, seg=[0, 0, 1, 1, 1], world_size=2)
    >>> balance_problems(ref, got)
    ['epoch 0 after the load: batches per rank [1, 2] (DDP hang risk)']
    """

    def sizes(run: Run, rows: Any, world_size: int) -> list[list[int]]:
        out = []
        for r in range(world_size):
            _, counts = np.unique(run.batch[rows & (run.rank == r)], return_counts=True)
            out.append([int(c) for c in counts])
        return out

    out: list[str] = []
    for seg in sorted({int(k) for k in np.unique(got.seg)} - {0}):
        for e in sorted({int(x) for x in np.unique(got.epoch[got.seg == seg])}):
            if batch_problems(sizes(ref, ref.epoch == e, ref.world_size), None, what=""):
                continue  # the uninterrupted run's own finding (rank balance)
            after = "the second load" if seg > 1 else "the load"
            rows = (got.seg == seg) & (got.epoch == e)
            out += batch_problems(
                sizes(got, rows, got.world_size), None, what=f"epoch {e} after {after}"
            )
    return out


def undeal(
    per_rank: Sequence[Sequence[Sequence[int]]], plan: EpochPlan, *, complete: bool, what: str
) -> tuple[dict[int, int], list[str]]:
    """Plan position -> sample, from each rank's batches of ``plan``'s pass (``complete``:
    the whole pass, else a prefix of it), and what does not fit the plan.

    >>> plan = EpochPlan(num_samples=5, world_size=2, batch_size=2)
    >>> undeal([[[9, 8], [5]], [[7, 6], [4]]], plan, complete=True, what="epoch 0")
    ({0: 9, 1: 8, 4: 5, 2: 7, 3: 6, 5: 4}, [])
    """
    out: dict[int, int] = {}
    problems = []
    for rank, batches in enumerate(per_rank):
        flat = [x for b in batches for x in b]
        positions = plan.rank_positions(rank).tolist()
        if len(flat) > len(positions) or (complete and len(flat) != len(positions)):
            problems.append(
                f"{what}: rank {rank} received {len(flat)} samples, its plan from position "
                f"{plan.start} has {len(positions)}"
            )
        for p, x in zip(positions, flat, strict=False):
            if p in out:
                problems.append(f"{what}: position {p} dealt twice")
            out[int(p)] = int(x)
    return out, problems


def position_problems(got: Mapping[int, int], order: Sequence[int], *, what: str) -> list[str]:
    """Every delivered plan position holds ``order``'s sample (a pad: the sample at the
    position it wraps to), and the positions delivered are all of the epoch's.

    >>> position_problems({0: 5, 1: 6, 2: 5}, [5, 6], what="epoch 0")
    []
    >>> position_problems({0: 6, 1: 5}, [5, 6, 7], what="epoch 0")  # doctest: +ELLIPSIS
    ['epoch 0: position -> (delivered, expected): {0: (6, 5), 1: (5, 6)}', 'epoch 0: ...']
    """
    n = len(order)

    def expected(p: int) -> int:
        return order[p if p < n else (p - n) % n]

    wrong = {p: (x, expected(p)) for p, x in sorted(got.items()) if x != expected(p)}
    out = []
    if wrong:
        out.append(f"{what}: position -> (delivered, expected): {dict(list(wrong.items())[:8])}")
    if sorted(p for p in got if p < n) != list(range(n)):
        out.append(f"{what}: positions delivered are not all of [0, {n})")
    return out


def stream_problems(
    got: Mapping[int, int], stream: Sequence[int], upto: int, *, what: str
) -> list[str]:
    """An endless stream delivered position by position: every position below ``upto``
    once, holding ``stream``'s sample.

    >>> stream_problems({0: 1, 1: 2}, [1, 3], 2, what="step 0")
    ['step 0: stream position -> (delivered, expected): {1: (2, 3)}']
    """
    wrong = {p: (x, stream[p]) for p, x in sorted(got.items()) if x != stream[p]}
    out = []
    if wrong:
        out.append(
            f"{what}: stream position -> (delivered, expected): {dict(list(wrong.items())[:8])}"
        )
    if sorted(got) != list(range(upto)):
        out.append(f"{what}: stream positions delivered are not all of [0, {upto})")
    return out


def prefix_matches(ref: Run, got: Run) -> bool:
    """Whether each rank's rows before the stop (seg 0) are the reference's first rows.

    >>> r = Run.of(ids=[1, 2], rank=[0, 0], epoch=[0, 0], batch=[0, 1], pos=[0, 0],
    ...            seg=[0, 0], world_size=1)
    >>> prefix_matches(r, Run.of(ids=[1], rank=[0], epoch=[0], batch=[0], pos=[0], seg=[0],
    ...                          world_size=1))
    True
    """
    for r in range(ref.world_size):
        mine = got.seg == 0
        a = got.ids[mine & (got.rank == r)]
        b = ref.ids[ref.rank == r][: len(a)]
        if not np.array_equal(a, b):
            return False
    return True


def _first_difference(a: I64, b: I64) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


def check_stop(
    ref: Run,
    got: Run,
    *,
    batch_size: int,
    reproducible: bool = True,
    label: Callable[[int], str] = str,
    topology_free: bool = True,
) -> StopCheck:
    """Compare ``got`` (a run that stopped and resumed) with ``ref``, epoch by epoch.

    ``reproducible``: ``got``'s rows before the stop match the reference's, rank by rank
    (see ``prefix_matches``); orders are compared only then.  ``topology_free``: the
    order does not depend on the world size (else, under another world size, orders are
    not compared: nothing promises them)."""
    out = StopCheck()
    same = got.world_size == ref.world_size
    compare_order = reproducible and (same or topology_free)
    if not reproducible:
        out.notes.append(
            "the run before the stop differs from the uninterrupted run (the loader is not "
            "reproducible between runs): orders not compared, only what was delivered"
        )
    ref_orders = {e: first_occurrences(ref.global_order(e)) for e in ref.epochs()}
    # Under another world size the epoch's last global step may be dealt otherwise (its
    # partial batches, its padding): the order is compared up to it, the tail by counts.
    tail = 0 if same else max(ref.world_size, got.world_size) * batch_size

    def agree(a: I64, b: I64) -> bool:
        if same:
            return bool(np.array_equal(a, b))
        n = max(0, len(b) - tail)
        return bool(len(a) >= n and np.array_equal(a[:n], b[:n]))

    for e in sorted(set(ref.epochs()) | set(got.epochs())):
        want = ref.ids[ref.epoch == e]
        have = got.ids[got.epoch == e]
        if len(have) == 0:
            out.problems.append(f"epoch {e}: nothing delivered (the epoch was skipped)")
            continue
        if len(want) == 0:
            out.problems.append(f"epoch {e}: {len(have)} samples of an epoch the run never had")
            continue
        allowed = 0 if same else got.world_size * batch_size - 1
        pads = 0 if same else (0, allowed)
        counted = count_problems(have, want, pads=pads, label=label, what=f"epoch {e}")
        out.problems += counted
        if not compare_order or counted:
            continue
        order, expected = first_occurrences(got.global_order(e)), ref_orders[e]
        if not agree(order, expected):
            other = [f for f, o in ref_orders.items() if f != e and agree(order, o)]
            if other:
                out.problems.append(f"epoch {e}: wrong epoch, delivered epoch {other[0]}'s order")
                continue
            if len(order) and len(expected) and order[0] != expected[0]:
                out.problems.append(
                    f"epoch {e}: wrong epoch, its order differs from its first sample on "
                    f"(an epoch skipped or replayed?)"
                )
                continue
        if same:
            for r in range(got.world_size):
                a, b = got.rank_order(e, r), ref.rank_order(e, r)
                if not np.array_equal(a, b):
                    i = _first_difference(a, b)
                    out.problems.append(
                        f"epoch {e}: rank {r} reordered from its sample {i} "
                        f"(batch {i // batch_size}: {label(int(a[i])) if i < len(a) else '-'}, "
                        f"{label(int(b[i])) if i < len(b) else '-'} expected)"
                    )
                    break
        elif not agree(order, expected):
            i = _first_difference(order, expected)
            out.problems.append(f"epoch {e}: reordered from global position {i}")
    return out
