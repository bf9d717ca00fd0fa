"""The planning core: which global positions each (rank, worker) reads, and in what order.

Pure Python and numpy: no torch, no I/O, and nothing of size ``num_samples``.

Vocabulary
----------
- *position*: an index into the epoch's global order, ``0 <= p < N``.  The sample at
  position ``p`` is ``order(p)``: the plan is *given* its order (a keyed permutation, a
  block shuffle, a mixture; ``None`` is the identity) and never chooses one itself.
- *virtual position*: the plan hands out positions ``>= N`` only as padding; virtual
  position ``v >= N`` reads position ``(v - N) % N`` (it wraps to the start of the
  epoch's order, as ``DistributedSampler`` does).  Per-sample random seeds use the
  virtual position, so a padded repeat gets draws of its own.
- *step*: global step ``s`` hands positions ``[start + s*R*B, start + (s+1)*R*B)`` to
  the ``R`` ranks, ``B`` each, in rank order.  The last step, if short, is shared as
  evenly as possible (rank ``r`` takes every ``R``-th position from ``r``) and, unless
  ``drop_last``, padded so every rank gets the same count (``pad="repeat"``, the
  default, or ``"mask"``: the same plan, pads recognisable), or left as it is
  (``pad="none"``: ranks get at most one sample, so one batch, apart; nothing
  repeated).  Whatever the ranks have consumed after ``k`` steps is therefore a prefix
  of the order: ``start`` is the length of the prefix consumed before this plan (a
  resume).
- Inside a rank, batch ``i`` is step ``i``; batches are dealt to the rank's ``W``
  workers round-robin (batch ``i`` to worker ``i % W``), which is the order in which a
  DataLoader collects them, so the rank's batch sequence is the map-style one.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

from evenly.core.permutation import as_int64 as as_positions
from evenly.core.permutation import sample_seeds
from evenly.errors import check_int
from evenly.options import PAD_MODES

__all__ = ["PAD_MODES", "PLAN_PAD_MODES", "EpochPlan", "Order", "as_positions"]

I64 = npt.NDArray[np.int64]


class Order(Protocol):
    """Position -> sample index, vectorised (a permutation of ``[0, N)`` for a shuffle)."""

    def __call__(self, positions: npt.ArrayLike) -> I64: ...


#: What a plan also takes: ``"full"`` pads the short last step up to a full global step
#: (every rank a full batch; packing's pad rows, at virtual positions ``>= N``).
PLAN_PAD_MODES = (*PAD_MODES, "full")

#: Positions computed per numpy call when walking a worker's share.
CHUNK = 8192


@dataclass(frozen=True)
class EpochPlan:
    """One epoch's plan for every rank and worker.

    >>> plan = EpochPlan(num_samples=10, world_size=2, batch_size=3)
    >>> [plan.batch_positions(rank=0, batch=i).tolist() for i in range(plan.num_batches)]
    [[0, 1, 2], [6, 8]]
    >>> [plan.batch_positions(rank=1, batch=i).tolist() for i in range(plan.num_batches)]
    [[3, 4, 5], [7, 9]]
    >>> from evenly.core import FeistelPermutation
    >>> shuffled = EpochPlan(num_samples=10, order=FeistelPermutation(10, seed=0, epoch=0))
    >>> sorted(shuffled.indices(range(10)).tolist()) == list(range(10))
    True

    ``seed`` and ``epoch`` key the per-sample random streams (:meth:`seeds`); the order
    is built by the caller (``evenly.core.order.make_order``) from the same values.
    """

    num_samples: int
    world_size: int = 1
    batch_size: int = 1
    drop_last: bool = False
    seed: int = 0
    epoch: int = 0
    start: int = 0
    #: position -> sample index; ``None`` is the identity (no shuffle).
    order: Order | None = None
    #: the short last step: ``"repeat"`` pads it with repeats, ``"mask"`` too (the
    #: transform is told which samples are pads), ``"none"`` leaves ranks unequal
    pad: str = "repeat"

    def __post_init__(self) -> None:
        if self.pad not in PLAN_PAD_MODES:
            raise ValueError(f"pad must be one of {list(PLAN_PAD_MODES)}, got {self.pad!r}")
        check_int("num_samples", self.num_samples, minimum=0)
        check_int("world_size", self.world_size, minimum=1)
        check_int("batch_size", self.batch_size, minimum=1)
        check_int("seed", self.seed)
        check_int("epoch", self.epoch, minimum=0)
        check_int("start", self.start, minimum=0)
        if self.start > self.num_samples:
            raise ValueError(
                f"start position {self.start} is past the end of the epoch "
                f"({self.num_samples} samples)"
            )

    # ---- sizes -------------------------------------------------------------------
    @property
    def remaining(self) -> int:
        """Positions of the epoch not consumed before this plan."""
        return self.num_samples - self.start

    @property
    def _step_size(self) -> int:
        return self.world_size * self.batch_size

    @property
    def _fills_last_step(self) -> bool:
        return self.pad == "full" and not self.drop_last

    @property
    def num_full_steps(self) -> int:
        if self._fills_last_step:  # the short last step is padded into a full one
            return -(-self.remaining // self._step_size)
        return self.remaining // self._step_size

    @property
    def _tail(self) -> int:
        return max(0, self.remaining - self.num_full_steps * self._step_size)

    @property
    def tail_per_rank(self) -> int:
        """Samples each rank gets in the last, short step (0 if there is none); under
        ``pad="none"`` the most any rank gets (rank 0's)."""
        if self.drop_last or self._tail == 0:
            return 0
        return -(-self._tail // self.world_size)

    def tail_of(self, rank: int) -> int:
        """Samples ``rank`` gets in the last, short step."""
        self._check_rank(rank)
        if self.pad != "none" or self.drop_last:
            return self.tail_per_rank
        return len(range(rank, self._tail, self.world_size))

    @property
    def num_batches(self) -> int:
        """Batches every rank yields (under ``pad="none"``: the most any rank yields,
        rank 0's; see :meth:`rank_batches`)."""
        return self.num_full_steps + (1 if self.tail_per_rank else 0)

    @property
    def samples_per_rank(self) -> int:
        """Samples every rank yields (under ``pad="none"``: rank 0's, the most)."""
        return self.num_full_steps * self.batch_size + self.tail_per_rank

    def rank_batches(self, rank: int) -> int:
        """Batches ``rank`` yields (the same for every rank unless ``pad="none"``)."""
        return self.num_full_steps + (1 if self.tail_of(rank) else 0)

    def rank_samples(self, rank: int) -> int:
        """Samples ``rank`` yields (the same for every rank unless ``pad="none"``)."""
        return self.num_full_steps * self.batch_size + self.tail_of(rank)

    @property
    def num_padded(self) -> int:
        """Repeated samples added so that every rank gets the same count (< world_size;
        0 under ``pad="none"``)."""
        if self.pad == "none":
            return 0
        if self._fills_last_step:
            return self.num_full_steps * self._step_size - self.remaining
        return self.tail_per_rank * self.world_size - (0 if self.drop_last else self._tail)

    @property
    def uneven(self) -> bool:
        """Whether ranks yield different numbers of samples (``pad="none"`` only)."""
        return self.pad == "none" and self.tail_of(self.world_size - 1) != self.tail_per_rank

    @property
    def num_dropped(self) -> int:
        """Samples left out by ``drop_last`` (< world_size * batch_size)."""
        return self._tail if self.drop_last else 0

    @property
    def end(self) -> int:
        """Consumed prefix length once every rank has finished this plan."""
        return self.num_samples - self.num_dropped

    def consumed_after(self, batches: int) -> int:
        """Prefix of the order consumed once every rank has yielded ``batches`` batches."""
        if batches >= self.num_batches:
            return self.end
        return self.start + batches * self._step_size

    def has_partial_batch(self) -> bool:
        return 0 < self.tail_per_rank < self.batch_size

    def idle_workers(self, num_workers: int) -> int:
        """Workers of a rank that get no batch at all."""
        return max(0, max(num_workers, 1) - self.num_batches)

    # ---- positions ---------------------------------------------------------------
    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must lie in [0, {self.world_size}), got {rank}")

    def batches_positions(self, rank: int, batches: npt.ArrayLike) -> I64:
        """Virtual positions of the given batches of ``rank``, concatenated in order."""
        self._check_rank(rank)
        b = np.asarray(batches, dtype=np.int64)
        full = b[b < self.num_full_steps]
        offsets = self.start + full * self._step_size + rank * self.batch_size
        out = (offsets[:, None] + np.arange(self.batch_size, dtype=np.int64)).ravel()
        tail_count = self.tail_of(rank)
        if b.size and int(b[-1]) == self.num_full_steps and tail_count:
            base = self.start + self.num_full_steps * self._step_size
            tail = base + rank + self.world_size * np.arange(tail_count, dtype=np.int64)
            out = np.concatenate([out, tail])
        return out

    def batch_positions(self, rank: int, batch: int) -> I64:
        """Virtual positions of batch ``batch`` of ``rank``."""
        batches = self.rank_batches(rank)
        if not 0 <= batch < batches:
            raise IndexError(f"batch must lie in [0, {batches}), got {batch}")
        return self.batches_positions(rank, [batch])

    def worker_batches(self, num_workers: int, worker_id: int, rank: int = 0) -> range:
        """Indices of ``rank``'s batches dealt to ``worker_id`` of ``num_workers``."""
        workers = max(num_workers, 1)
        if not 0 <= worker_id < workers:
            raise ValueError(f"worker_id must lie in [0, {workers}), got {worker_id}")
        return range(worker_id, self.rank_batches(rank), workers)

    def iter_worker_chunks(
        self, rank: int, num_workers: int, worker_id: int, chunk: int = CHUNK, first: int = 0
    ) -> Iterator[tuple[I64, int]]:
        """Yield ``(virtual positions, batch length)`` for runs of this worker's batches,
        from its ``first``-th batch on.

        Each chunk holds whole batches; all batches in a chunk have the given length
        (the short last batch always comes in a chunk of its own).
        """
        batches = self.worker_batches(num_workers, worker_id, rank)[first:]
        per = max(1, chunk // self.batch_size)
        full_end = min(len(batches), len(range(batches.start, self.num_full_steps, batches.step)))
        for i in range(0, full_end, per):
            sel = batches[i : min(i + per, full_end)]
            yield (
                self.batches_positions(rank, np.arange(sel.start, sel.stop, sel.step)),
                (self.batch_size),
            )
        if full_end < len(batches):
            yield self.batches_positions(rank, [batches[full_end]]), self.tail_of(rank)

    def rank_positions(self, rank: int) -> I64:
        """All virtual positions of ``rank`` in this plan (small plans and tests only)."""
        return self.batches_positions(rank, np.arange(self.rank_batches(rank)))

    def pads(self, positions: npt.ArrayLike) -> npt.NDArray[np.bool_]:
        """Which of the given virtual positions are padding (repeats past the end)."""
        return as_positions(positions) >= self.num_samples

    # ---- positions -> samples ----------------------------------------------------
    @property
    def shuffle(self) -> bool:
        """Whether the order is a shuffle (not the identity)."""
        return self.order is not None

    def indices(self, positions: npt.ArrayLike) -> I64:
        """Sample indices at the given virtual positions (any shape; the same shape back)."""
        v = as_positions(positions)
        n = self.num_samples
        if n == 0:
            if v.size:
                raise IndexError("the epoch has no samples")
            return v.copy()
        if v.size and int(v.min()) < 0:
            raise IndexError(f"positions must be >= 0, got {int(v.min())}")
        p = np.where(v >= n, (v - n) % n, v)
        if self.order is None:
            return p
        return np.asarray(self.order(p), dtype=np.int64).reshape(p.shape)

    def seeds(self, positions: npt.ArrayLike) -> npt.NDArray[np.uint64]:
        """Per-sample seeds at the given virtual positions (independent of the shuffle)."""
        return sample_seeds(self.seed, self.epoch, positions)

    def describe(self) -> str:
        """One line on padding / dropping, for warnings and logs."""
        if self.uneven:
            low = self.rank_samples(self.world_size - 1)
            return (
                f"pad='none': the {self.world_size} ranks get {low} or "
                f"{self.samples_per_rank} samples (nothing repeated, nothing dropped)"
            )
        if self.num_padded and self._fills_last_step:
            return (
                f"{self.num_padded} pad row(s) added so that each of the {self.world_size} "
                f"rank(s) gets {self.num_batches} full batch(es) of {self.batch_size}"
            )
        if self.num_padded:
            return (
                f"{self.num_padded} sample(s) repeated so that each of the {self.world_size} "
                f"rank(s) gets {self.samples_per_rank} samples in {self.num_batches} batch(es)"
            )
        if self.num_dropped:
            return (
                f"drop_last=True leaves out {self.num_dropped} sample(s) so that every batch "
                f"holds {self.batch_size} samples"
            )
        return "exactly once, no padding"
