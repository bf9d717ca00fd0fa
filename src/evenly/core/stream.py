"""Training by steps: batches over an endless stream of epochs.

Epoch ``e``'s order fills stream positions ``[e*N, (e+1)*N)``; global step ``s`` hands
stream positions ``[start + s*G, start + (s+1)*G)`` to the ranks, ``B`` each in rank
order (``G = world_size * batch_size``), so every batch is full (a batch may span an
epoch boundary), each epoch is still read exactly once, and what all ranks consumed is
a prefix of the stream: a checkpoint is one integer, resumable under any topology.
Per-sample seeds are those of (epoch, position in the epoch), as in epoch mode.

Epochs of different lengths (packed rows under ``best_fit``: each epoch packs into its
own row count): given ``lengths(e)``, positions count from the start of epoch
``first_epoch`` (a checkpoint is then (epoch, position in it), as in epoch mode), and an
epoch's length is asked for only when the stream reaches it.

Pure numpy: no torch, no I/O, nothing of size N.

>>> from evenly.core.permutation import FeistelPermutation
>>> plan = StreamPlan(num_samples=5, world_size=2, batch_size=2,
...                   orders=lambda e: None)
>>> [plan.batches_positions(r, [0, 1]).tolist() for r in range(2)]
[[0, 1, 4, 5], [2, 3, 6, 7]]
>>> plan.indices([4, 5, 6, 7]).tolist(), plan.epochs_of([4, 5]).tolist()
([4, 0, 1, 2], [0, 1])
>>> varied = StreamPlan(num_samples=3, start=1, lengths=lambda e: 3 + e, first_epoch=2)
>>> varied.locate(varied.consumed_after(5)), varied.epochs_of([4, 5, 11]).tolist()
((3, 1), [2, 3, 4])
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from itertools import count

import numpy as np
import numpy.typing as npt

from evenly.core.permutation import as_int64, sample_seeds
from evenly.core.plan import CHUNK, Order
from evenly.errors import check_int

__all__ = ["StreamPlan"]

I64 = npt.NDArray[np.int64]


@dataclass(frozen=True)
class StreamPlan:
    """An endless plan over consecutive epochs (``orders(e)`` is epoch ``e``'s order,
    ``None`` for the identity); ``start`` is the stream position consumed before it."""

    num_samples: int
    world_size: int = 1
    batch_size: int = 1
    seed: int = 0
    start: int = 0
    orders: Callable[[int], Order | None] = field(default=lambda e: None, compare=False)
    #: epoch -> its length, where epochs differ (None: every epoch has ``num_samples``)
    lengths: Callable[[int], int] | None = field(default=None, compare=False)
    #: with ``lengths``: the epoch whose start is stream position 0
    first_epoch: int = 0
    _cache: dict[int, Order | None] = field(default_factory=dict, compare=False, repr=False)
    #: with ``lengths``: the stream positions where epochs first_epoch, ... start
    _starts: list[int] = field(default_factory=lambda: [0], compare=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, compare=False, repr=False)

    def __post_init__(self) -> None:
        check_int("num_samples", self.num_samples, minimum=1)
        check_int("world_size", self.world_size, minimum=1)
        check_int("batch_size", self.batch_size, minimum=1)
        check_int("start", self.start, minimum=0)

    @property
    def epoch(self) -> int:
        """The epoch the plan starts in."""
        return self.locate(self.start)[0]

    def split(self, positions: npt.ArrayLike) -> tuple[I64, I64]:
        """(epoch, position in it) of each stream position."""
        pos = as_int64(positions)
        if self.lengths is None:
            epochs, within = np.divmod(pos, self.num_samples)
            return epochs, within
        starts = self._starts_to(int(pos.max()) if pos.size else 0)
        k = np.searchsorted(starts, pos, side="right") - 1
        return k + self.first_epoch, pos - starts[k]

    def locate(self, position: int) -> tuple[int, int]:
        """(epoch, position in it) of one stream position (a checkpoint's)."""
        epochs, within = self.split([position])
        return int(epochs[0]), int(within[0])

    def _starts_to(self, position: int) -> I64:
        """Epoch starts, asking the lengths of epochs up to the one holding ``position``
        (each once; reader threads share the plan: no reliance on the GIL)."""
        assert self.lengths is not None
        with self._lock:
            starts = self._starts
            while starts[-1] <= position:
                epoch = self.first_epoch + len(starts) - 1
                n = int(self.lengths(epoch))
                if n < 1:
                    raise ValueError(f"evenly: epoch {epoch} of the stream has no samples")
                starts.append(starts[-1] + n)
            return np.asarray(starts, dtype=np.int64)

    @property
    def step_size(self) -> int:
        return self.world_size * self.batch_size

    def consumed_after(self, batches: int) -> int:
        """Stream position consumed once every rank has yielded ``batches`` batches."""
        return self.start + batches * self.step_size

    def batches_positions(self, rank: int, batches: npt.ArrayLike) -> I64:
        """Stream positions of the given batches of ``rank``, concatenated in order."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must lie in [0, {self.world_size}), got {rank}")
        b = as_int64(batches).reshape(-1)
        offsets = self.start + b * self.step_size + rank * self.batch_size
        return (offsets[:, None] + np.arange(self.batch_size, dtype=np.int64)).ravel()

    def iter_worker_chunks(
        self, rank: int, num_workers: int, worker_id: int, chunk: int = CHUNK, first: int = 0
    ) -> Iterator[tuple[I64, int]]:
        """Endless ``(stream positions, batch length)`` runs of this worker's batches
        (batch ``i`` of the rank goes to worker ``i % num_workers``), from its
        ``first``-th batch on."""
        workers = max(num_workers, 1)
        per = max(1, chunk // self.batch_size)
        for lo in count(first, per):
            mine = worker_id + workers * np.arange(lo, lo + per, dtype=np.int64)
            yield self.batches_positions(rank, mine), self.batch_size

    def epochs_of(self, positions: npt.ArrayLike) -> I64:
        """The epoch of each stream position."""
        return self.split(positions)[0]

    def _order(self, epoch: int) -> Order | None:
        if epoch not in self._cache:
            if len(self._cache) > 4:
                self._cache.clear()
            self._cache[epoch] = self.orders(epoch)
        return self._cache[epoch]

    def indices(self, positions: npt.ArrayLike) -> I64:
        """Sample indices at the given stream positions (same shape back)."""
        epochs, within = self.split(positions)
        out = within.copy()
        for e in np.unique(epochs).tolist():
            order = self._order(int(e))
            if order is not None:
                sel = epochs == e
                out[sel] = np.asarray(order(within[sel]), dtype=np.int64)
        return out

    def pads(self, positions: npt.ArrayLike) -> npt.NDArray[np.bool_]:
        """No padding: every batch of a stream is full of real samples."""
        return np.zeros(as_int64(positions).shape, dtype=np.bool_)

    def seeds(self, positions: npt.ArrayLike) -> npt.NDArray[np.uint64]:
        """Per-sample seeds: those of (epoch, position in the epoch)."""
        epochs, within = self.split(positions)
        out = np.empty(within.shape, dtype=np.uint64)
        for e in np.unique(epochs).tolist():
            sel = epochs == e
            out[sel] = sample_seeds(self.seed, int(e), within[sel])
        return out
