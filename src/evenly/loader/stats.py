"""``loader.stats()``: per epoch, what the loader delivered and where the time went.

Workers time each batch's stages (``runtime/clock.py``) and send the figures with the
batch (with no workers, the main process's clock is read when the stats are); the main
process adds how long the training loop waited in ``next()``.  What is recorded costs a
few clock reads and one small tuple per batch (``bench/bench_stats.py`` measures it).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from time import perf_counter
from typing import Any

from evenly.runtime.clock import COUNTERS, MAXIMA, STAGES, StageClock

__all__ = ["EpochStats", "LoaderStats", "PassRecorder", "StatsLog", "as_dict"]


@dataclass(frozen=True)
class EpochStats:
    """One pass of an ``evenly.DataLoader`` (an epoch; with ``infinite=True``, one
    ``iter()``), as far as the training loop has received it.

    Stage seconds are summed over the workers (with 4 busy workers, up to 4 seconds of
    stage time per second): ``read`` is the source's ``__getitem__``/``__getitems__`` (or
    ``read_columns``), less what the source reports as fetching and decoding; ``fetch``
    the time reads waited for remote shards to download; ``transform`` the
    dataset's transform under its per-sample seeds; ``collate`` the ``collate_fn``;
    ``handoff`` the copy into the worker's shared-memory slot and out of it in the main
    process.  Byte counts and cache hits are ``None`` unless the source reports them
    (an ``io_stats()`` method returning cumulative ``bytes_read``, ``bytes_decoded``,
    ``decode_seconds``, ``cache_hits``, ``cache_misses``); remote sources add what
    their shard cache fetched: ``bytes_fetched``, ``fetch_requests`` (GETs, retries
    included), ``fetch_retries`` (requests retried after a transient error: a reset, a
    short body, a stall past the read timeout, 503 SlowDown, 429) and
    ``max_in_flight_seen`` (the most downloads one process ran at once).
    """

    epoch: int
    batches: int
    samples: int
    #: from the first ``next()`` to the last batch received (or the end of the pass)
    seconds: float
    #: time the training loop spent inside ``next(iterator)``: waiting for data
    waited_seconds: float
    read_seconds: float
    decode_seconds: float
    transform_seconds: float
    collate_seconds: float
    handoff_seconds: float
    bytes_read: int | None = None
    bytes_decoded: int | None = None
    cache_hits: int | None = None
    cache_misses: int | None = None
    #: time reads waited for remote shards (0 for local data)
    fetch_seconds: float = 0.0
    bytes_fetched: int | None = None
    fetch_requests: int | None = None
    fetch_retries: int | None = None
    max_in_flight_seen: int | None = None
    #: the pass ran to its end
    finished: bool = False

    @property
    def samples_per_second(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else 0.0

    @property
    def waited_fraction(self) -> float:
        """The share of the epoch's time the loop waited for data (0 .. 1)."""
        return min(1.0, self.waited_seconds / self.seconds) if self.seconds > 0 else 0.0

    @property
    def cache_hit_rate(self) -> float | None:
        """Hits / (hits + misses) of the source's cache, ``None`` without one."""
        if self.cache_hits is None or self.cache_misses is None:
            return None
        looked = self.cache_hits + self.cache_misses
        return self.cache_hits / looked if looked else None

    @property
    def stages(self) -> dict[str, float]:
        """Seconds per worker stage, by name (read, fetch, decode, transform, collate,
        handoff)."""
        return {stage: getattr(self, f"{stage}_seconds") for stage in STAGES}

    @property
    def slowest_stage(self) -> str:
        """The stage the workers spent most time in."""
        stages = self.stages
        return max(stages, key=stages.__getitem__)


@dataclass(frozen=True)
class LoaderStats:
    """What ``evenly.DataLoader.stats()`` returns: one :class:`EpochStats` per pass,
    oldest first (the last ``keep`` passes, 100 by default).

    >>> import evenly
    >>> loader = evenly.DataLoader(evenly.Dataset(list(range(10))), batch_size=4)
    >>> _ = list(loader)
    >>> last = loader.stats().last
    >>> last.epoch, last.batches, last.samples, last.finished
    (0, 3, 10, True)
    >>> sorted(last.stages)
    ['collate', 'decode', 'fetch', 'handoff', 'read', 'transform']
    """

    epochs: tuple[EpochStats, ...]

    @property
    def last(self) -> EpochStats | None:
        """The pass in progress, or the last one; ``None`` before any."""
        return self.epochs[-1] if self.epochs else None

    def table(self) -> str:
        """The figures as a small plain-text table, one row per pass."""
        head = f"{'epoch':>5} {'batches':>7} {'samples/s':>10} {'waited':>7}  slowest stage"
        rows = [head]
        for e in self.epochs:
            rows.append(
                f"{e.epoch:>5} {e.batches:>7} {e.samples_per_second:>10,.0f} "
                f"{e.waited_fraction:>6.0%}  {e.slowest_stage}"
            )
        return "\n".join(rows)


#: batches whose worker figures are kept as they came before they are summed
_FOLD = 64


def _sums(times: list[tuple[float, ...]]) -> tuple[float, list[float], list[int | None]]:
    """Samples, stage seconds and counters (None: not reported) of a list of batches'
    worker figures (:meth:`StageClock.take` tuples)."""
    if not times:
        return 0, [0.0] * len(STAGES), [None] * len(COUNTERS)
    columns = list(zip(*times, strict=False)) if len({len(t) for t in times}) == 1 else None
    if columns is None:  # figures with and without counters (a restarted pass)
        wide = max(len(t) for t in times)
        columns = list(zip(*(t + (-1,) * (wide - len(t)) for t in times), strict=True))
    counters: list[int | None] = [None] * len(COUNTERS)
    for i, column in enumerate(columns[1 + len(STAGES) :]):
        reported = [v for v in column if v >= 0]
        if reported:
            counters[i] = int(max(reported) if COUNTERS[i] in MAXIMA else sum(reported))
    return sum(columns[0]), [sum(c) for c in columns[1 : 1 + len(STAGES)]], counters


class PassRecorder:
    """The running totals of one pass (the main process).

    :meth:`add` keeps each batch's worker figures as they came and sums them once per
    :data:`_FOLD` batches (a few hundred nanoseconds a batch); :meth:`freeze` adds
    those not summed yet, changing nothing.  A pass read in the main process sends its
    clock instead of figures: it is read when the stats are."""

    __slots__ = (
        "batches",
        "copied",
        "counters",
        "ended",
        "epoch",
        "finished",
        "live",
        "pending",
        "samples",
        "stages",
        "started",
        "waited",
    )

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch
        self.batches = self.samples = 0
        self.waited = self.copied = 0.0
        self.stages = [0.0] * len(STAGES)
        self.counters: list[int | None] = [None] * len(COUNTERS)
        self.pending: list[tuple[float, ...]] = []
        #: the clock of a pass read in this process (no workers), read by freeze()
        self.live: StageClock | None = None
        self.started: float | None = None
        self.ended: float | None = None
        self.finished = False

    def add(
        self, times: tuple[float, ...] | StageClock, started: float, got: float, copied: bool
    ) -> None:
        """A batch received: its worker figures (or the clock of a pass read in this
        process), the wait (from ``started`` to now) and, if the main process ``copied``
        the batch out of a slot since ``got``, that copy (hand-off time)."""
        now = perf_counter() if copied else got
        self.batches += 1
        self.waited += now - started
        if copied:
            self.copied += now - got
        if type(times) is tuple:
            pending = self.pending
            pending.append(times)
            if len(pending) >= _FOLD:
                self.pending = []
                self.stages, self.counters, self.samples = self._total(pending)
        elif times is not self.live:  # a pass restarted in place: keep the old clock's
            if self.live is not None:
                self.stages, self.counters, self.samples = self._total([self.live.peek()])
            self.live = times  # type: ignore[assignment]
        self.ended = now

    def _total(self, pending: list[tuple[float, ...]]) -> tuple[list[float], list[int | None], int]:
        """The stages, counters and samples with ``pending`` added."""
        samples, stages, counters = _sums(pending)
        both = zip(COUNTERS, self.counters, counters, strict=True)
        return (
            [a + b for a, b in zip(self.stages, stages, strict=True)],
            [
                b if a is None else a if b is None else max(a, b) if k in MAXIMA else a + b
                for k, a, b in both
            ],
            self.samples + int(samples),
        )

    def count(self, values: dict[str, float]) -> None:
        """Add counts made in the main process outside any batch (the pass start's
        listing retries, say) to the pass's counters."""
        for name, value in values.items():
            i = COUNTERS.index(name)
            then = self.counters[i]
            self.counters[i] = int(value) if then is None else then + int(value)

    def end(self, started: float) -> None:
        now = perf_counter()
        self.waited += now - started
        self.ended, self.finished = now, True

    def freeze(self) -> EpochStats:
        seconds = 0.0 if self.started is None else (self.ended or self.started) - self.started
        pending = list(self.pending)
        if self.live is not None:
            pending.append(self.live.peek())
        stages, counters, samples = self._total(pending)
        read, fetch, decode, transform, collate, handoff = stages
        handoff += self.copied
        bytes_read, bytes_decoded, hits, misses, fetched, requests, retries, flight = counters
        return EpochStats(
            epoch=self.epoch,
            batches=self.batches,
            samples=samples,
            seconds=seconds,
            waited_seconds=self.waited,
            read_seconds=read,
            decode_seconds=decode,
            transform_seconds=transform,
            collate_seconds=collate,
            handoff_seconds=handoff,
            bytes_read=bytes_read,
            bytes_decoded=bytes_decoded,
            cache_hits=hits,
            cache_misses=misses,
            fetch_seconds=fetch,
            bytes_fetched=fetched,
            fetch_requests=requests,
            fetch_retries=retries,
            max_in_flight_seen=flight,
            finished=self.finished,
        )


class StatsLog:
    """The recorders of a loader's passes, newest last, at most ``keep``."""

    def __init__(self, keep: int = 100) -> None:
        self.keep = keep
        self._passes: list[PassRecorder] = []

    def begin(self, epoch: int) -> PassRecorder:
        recorder = PassRecorder(epoch)
        self._passes = [*self._passes[-(self.keep - 1) :], recorder]
        return recorder

    def snapshot(self) -> LoaderStats:
        return LoaderStats(tuple(r.freeze() for r in self._passes))


def as_dict(stats: EpochStats) -> dict[str, Any]:
    """The fields of ``stats`` and its derived figures, for JSON."""
    out: dict[str, Any] = {f.name: getattr(stats, f.name) for f in fields(stats)}
    out.update(
        samples_per_second=stats.samples_per_second,
        waited_fraction=stats.waited_fraction,
        cache_hit_rate=stats.cache_hit_rate,
    )
    return out
