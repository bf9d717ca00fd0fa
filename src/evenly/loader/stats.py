"""``loader.stats()``: per epoch, what the loader delivered and where the time went.

Workers time each batch's stages (``runtime/clock.py``) and send the figures with the
batch; the main process adds how long the training loop waited in ``next()``.  What is
recorded costs a few clock reads and one small tuple per batch (``bench/bench_stats.py``
measures it).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from time import perf_counter
from typing import Any

from evenly.runtime.clock import COUNTERS, STAGES

__all__ = ["EpochStats", "LoaderStats", "PassRecorder", "StatsLog", "as_dict"]


@dataclass(frozen=True)
class EpochStats:
    """One pass of an ``evenly.DataLoader`` (an epoch; with ``infinite=True``, one
    ``iter()``), as far as the training loop has received it.

    Stage seconds are summed over the workers (with 4 busy workers, up to 4 seconds of
    stage time per second): ``read`` is the source's ``__getitem__``/``__getitems__`` (or
    ``read_columns``), less what the source reports as decoding; ``transform`` the
    dataset's transform under its per-sample seeds; ``collate`` the ``collate_fn``;
    ``handoff`` the copy into the worker's shared-memory slot and out of it in the main
    process.  Byte counts and cache hits are ``None`` unless the source reports them
    (an ``io_stats()`` method returning cumulative ``bytes_read``, ``bytes_decoded``,
    ``decode_seconds``, ``cache_hits``, ``cache_misses``).
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
        """Seconds per worker stage, by name (read, decode, transform, collate, handoff)."""
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
    ['collate', 'decode', 'handoff', 'read', 'transform']
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


class PassRecorder:
    """The running totals of one pass (the main process)."""

    __slots__ = (
        "batches",
        "counters",
        "ended",
        "epoch",
        "finished",
        "samples",
        "stages",
        "started",
        "waited",
    )

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch
        self.batches = self.samples = 0
        self.waited = 0.0
        self.stages = [0.0] * len(STAGES)
        self.counters: list[int | None] = [None] * len(COUNTERS)
        self.started: float | None = None
        self.ended: float | None = None
        self.finished = False

    def add(self, times: tuple[float, ...], started: float, got: float) -> None:
        """A batch received: its worker figures, the wait, the main process's copy-out."""
        now = perf_counter()
        self.batches += 1
        self.samples += int(times[0])
        self.waited += now - started
        stages = self.stages
        stages[0] += times[1]
        stages[1] += times[2]
        stages[2] += times[3]
        stages[3] += times[4]
        stages[4] += times[5] + now - got
        if len(times) > 6:  # the source reports counters
            counters = self.counters
            for i, value in enumerate(times[6:]):
                if value >= 0:
                    counters[i] = int(value) + (counters[i] or 0)
        self.ended = now

    def end(self, started: float) -> None:
        now = perf_counter()
        self.waited += now - started
        self.ended, self.finished = now, True

    def freeze(self) -> EpochStats:
        seconds = 0.0 if self.started is None else (self.ended or self.started) - self.started
        read, decode, transform, collate, handoff = self.stages
        bytes_read, bytes_decoded, hits, misses = self.counters
        return EpochStats(
            epoch=self.epoch,
            batches=self.batches,
            samples=self.samples,
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
