"""A worker's per-batch stage clock for ``loader.stats()``: where a batch's time went
(read, decode, transform, collate, hand-off), how many samples it holds and what the
source says it read, decoded and found in its cache.

Each stage is timed once per batch (no per-sample timers); the time a read waited for
a remote shard to download (the source's ``fetch_seconds``) is the ``fetch`` stage, not
read or decode; :meth:`StageClock.take` turns
what was measured since the last call into a small tuple that travels with the batch
to the main process.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from time import perf_counter

__all__ = ["COUNTERS", "MAXIMA", "STAGES", "StageClock", "perf_counter"]

STAGES = ("read", "fetch", "decode", "transform", "collate", "handoff")
#: the counters a source may report through ``io_stats()`` (cumulative, per process)
COUNTERS = (
    "bytes_read",
    "bytes_decoded",
    "cache_hits",
    "cache_misses",
    "bytes_fetched",
    "fetch_requests",
    "fetch_retries",
    "max_in_flight_seen",
)
#: counters that are a maximum, sent as they are (not as a difference) and combined by max
MAXIMA = frozenset({"max_in_flight_seen"})


class StageClock:
    """Seconds per stage and counts, since the last :meth:`take`.

    >>> clock = StageClock()
    >>> clock.read += 0.5; clock.samples += 4
    >>> clock.take()[:7]
    (4, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0)
    >>> clock.take()[0]
    0
    """

    __slots__ = (
        "_last",
        "_sent",
        "collate",
        "decode",
        "fetch",
        "handoff",
        "read",
        "samples",
        "transform",
    )

    def __init__(self) -> None:
        self.samples = 0
        self.read = self.fetch = self.decode = self.transform = self.collate = 0.0
        self.handoff = 0.0
        #: the source's counters at the last :meth:`count`
        self._last: dict[str, float] = {}
        #: ... and as the last :meth:`take` sent them
        self._sent: dict[str, float] = {}

    def start(self, io_stats: Callable[[], Mapping[str, float]] | None) -> None:
        """Take the source's counters as they are when a pass starts as the zero."""
        if io_stats is not None:
            self._last = dict(io_stats())
            self._sent = dict(self._last)

    def count(self, io_stats: Callable[[], Mapping[str, float]] | None) -> None:
        """Read the source's counters (after a batch's read); its decode and fetch
        seconds move from the read stage to the decode and fetch stages."""
        if io_stats is None:
            return
        now, last = io_stats(), self._last
        decode = float(now.get("decode_seconds", 0.0)) - last.get("decode_seconds", 0.0)
        fetch = float(now.get("fetch_seconds", 0.0)) - last.get("fetch_seconds", 0.0)
        self.decode += decode
        self.fetch += fetch
        self.read -= decode + fetch
        last.update(now)

    def take(self) -> tuple[float, ...]:
        """(samples, read, fetch, decode, transform, collate, handoff) since the last
        call, then the source's counters (:data:`COUNTERS`, -1 for one it lacks) if it
        reports any (those of :data:`MAXIMA` as they are, the others since the last call)."""
        out = self.peek()
        self.samples = 0
        self.read = self.fetch = self.decode = self.transform = self.collate = 0.0
        self.handoff = 0.0
        if self._last:
            self._sent.update(self._last)
        return out

    def peek(self) -> tuple[float, ...]:
        """What :meth:`take` would return now, changing nothing (a clock in the main
        process is read this way by ``loader.stats()``, with no per-batch tuple)."""
        out: tuple[float, ...] = (
            self.samples,
            self.read,
            self.fetch,
            self.decode,
            self.transform,
            self.collate,
            self.handoff,
        )
        last = self._last
        if last:
            sent = self._sent
            out += tuple(
                -1 if k not in last else last[k] if k in MAXIMA else last[k] - sent.get(k, 0)
                for k in COUNTERS
            )
        return out
