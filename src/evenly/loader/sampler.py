"""``evenly.BatchSampler``: the plan of ``evenly.Dataset`` for map-style datasets.

A map-style dataset already gives every DataLoader worker explicit indices; what
``DistributedSampler`` gets wrong is the rest: a new order each epoch needs
``set_epoch``, ranks can end with different batch counts, padding is silent, and a
mid-epoch resume is not exact.  This batch sampler hands each rank the batches of the
same :class:`~evenly.core.EpochPlan` as ``evenly.Dataset``: one global permutation per
(seed, epoch), sharded after the shuffle, equal batch counts on every rank, padding
below ``world_size`` and reported.  It runs in the main process of each rank and
computes a batch's indices only when it is drawn, a few thousand at a time, so an epoch
of 10**9 samples plans in constant memory.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
from torch.utils.data import Sampler

from evenly.core.order import make_order
from evenly.core.passes import Pass, PassOwner, PassTracker
from evenly.core.plan import CHUNK, EpochPlan
from evenly.core.state import PassState
from evenly.core.topology import Topology
from evenly.errors import EvenlyWarning, StateError, check_int
from evenly.options import SAMPLER_PADS, SamplerPad
from evenly.runtime.checks import uneven_batches
from evenly.runtime.detect import resolve_topology, warn_if_rank_local

__all__ = ["BatchSampler"]


class BatchSampler(PassOwner, Sampler[list[int]]):
    """A batch sampler for map-style datasets with the guarantees of ``evenly.Dataset``.

    Each ``iter()`` starts the next epoch (no ``set_epoch`` needed) and yields this
    rank's batches of sample indices: every sample exactly once per epoch across ranks
    (up to the reported padding, fewer than ``world_size`` repeats), one global shuffle
    per ``(seed, epoch)`` done before sharding, and the same number of batches on every
    rank, at most one of them partial.

    >>> import torch
    >>> from evenly import BatchSampler
    >>> data = list(range(10))
    >>> sampler = BatchSampler(len(data), batch_size=4, seed=1, rank=0, world_size=2)
    >>> loader = torch.utils.data.DataLoader(data, batch_sampler=sampler)
    >>> len(loader), sampler.plan.num_padded
    (2, 0)
    >>> first = [x for batch in loader for x in batch.tolist()]
    >>> second = [x for batch in loader for x in batch.tolist()]  # epoch 1: reshuffled
    >>> len(first), first != second
    (5, True)

    Checkpoints: ``state_dict(batches_received=k)`` records how far the training loop
    got (a prefix of the epoch's global order, valid under any world size or batch
    size); ``load_state_dict`` makes the next ``iter()`` continue from there.  Under
    torchdata's ``StatefulDataLoader`` this happens by itself.

    Args:
        num_samples: ``len(dataset)``.
        batch_size: samples per batch on each rank.
        shuffle: one keyed permutation of all samples per epoch (else index order).
        seed: the seed of the shuffle; every rank must use the same one.
        drop_last: drop the epoch's remainder (fewer than ``world_size * batch_size``
            samples) instead of padding the last batches.
        rank: overrides the detected rank (detected from ``process_group``, else
            ``torch.distributed``'s default group, else ``RANK``/``WORLD_SIZE``).
        world_size: overrides the detected world size (detected as ``rank`` is).
        process_group: the data-parallel group (a ProcessGroup or a DeviceMesh
            dimension): the rank and world size are taken within it.
        pad: ``"repeat"`` (default: the short last step is padded with fewer than
            ``world_size`` repeats, so every rank yields the same batches) or ``"none"``
            (exact evaluation: nothing repeated; ranks yield at most one batch apart, so
            no collective may run at every step).
    """

    def __init__(
        self,
        num_samples: int,
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        rank: int | None = None,
        world_size: int | None = None,
        process_group: Any | None = None,
        pad: SamplerPad = "repeat",
    ) -> None:
        if hasattr(num_samples, "__len__"):
            raise TypeError(
                f"num_samples must be an integer, got a {type(num_samples).__name__}: "
                f"pass len(dataset)"
            )
        self.num_samples = check_int("num_samples", num_samples, minimum=0)
        self.batch_size = check_int("batch_size", batch_size, minimum=1)
        if not isinstance(shuffle, bool):
            raise TypeError(f"shuffle must be True or False, got {shuffle!r}")
        self.shuffle = shuffle
        self.seed = check_int("seed", seed)
        self.drop_last = bool(drop_last)
        if pad not in SAMPLER_PADS:
            raise ValueError(
                f"evenly.BatchSampler: pad must be 'repeat' or 'none', got {pad!r} (pad='mask' "
                f"needs a per-sample transform: use evenly.Dataset(..., pad='mask'))"
            )
        self.pad = pad
        self._rank = None if rank is None else check_int("rank", rank, minimum=0)
        self._world_size = (
            None if world_size is None else check_int("world_size", world_size, minimum=1)
        )
        if self._rank is not None and self._world_size is not None:
            Topology(self._rank, self._world_size)
        self.process_group = process_group
        self._warned_rank_local = False
        self._passes = PassTracker()
        #: (pass, batches handed out) when StatefulDataLoader last asked the iterator
        self._snapshot: tuple[Pass | None, int] = (None, -1)
        #: (pass, batches handed out) of a default state_dict() not confirmed yet
        self._unconfirmed: tuple[Pass | None, int] = (None, -1)
        self._pending = False  # a loaded state counted batches handed out
        #: The pass in progress (or the last one); ``None`` once a new one is due.
        self._pass: Pass | None = None
        self._current_plan = self._plan(0, 0, 1)
        self._current_rank = 0

    # ---- plan ------------------------------------------------------------------
    def topology(self) -> Topology:
        """This rank's (rank, world_size), resolved now."""
        if not self._warned_rank_local:
            self._warned_rank_local = warn_if_rank_local(
                self._world_size, self.process_group, "evenly.BatchSampler"
            )
        return resolve_topology(self._rank, self._world_size, self.process_group)

    def _plan(self, epoch: int, start: int, world_size: int) -> EpochPlan:
        mode = "global" if self.shuffle else "none"
        return EpochPlan(
            num_samples=self.num_samples,
            world_size=world_size,
            batch_size=self.batch_size,
            drop_last=self.drop_last,
            seed=self.seed,
            epoch=epoch,
            start=start,
            pad=self.pad,
            order=make_order(mode, self.num_samples, seed=self.seed, epoch=epoch),
        )

    def _in_progress(self) -> Pass | None:
        current = self._pass
        return current if current is not None and not current.finished else None

    @property
    def plan(self) -> EpochPlan:
        """The plan of the pass in progress, or of the next one: sizes, padding, drops."""
        current = self._in_progress()
        if current is not None:
            return self._current_plan
        start = self._passes.next_start()
        return self._plan(start.epoch, start.position, self.topology().world_size)

    @property
    def epoch(self) -> int:
        """The epoch of the pass in progress, or of the next one."""
        current = self._in_progress()
        return current.start.epoch if current is not None else self._passes.next_start().epoch

    # ---- the pass owner's contract (len(), remaining_batches: core.passes) ----------
    def _running(self) -> Pass | None:
        return self._in_progress()

    def _next_start(self) -> PassState:
        return self._passes.next_start()

    def _pass_rank(self) -> int:
        return self.topology().rank

    def set_epoch(self, epoch: int) -> None:
        """Make the next ``iter()`` epoch ``epoch``, from its start (reproduced exactly);
        later passes follow it.  A pass with batches left to draw is not affected.

        A state loaded for this very epoch and not started yet is kept: frameworks
        (Lightning) call ``set_epoch`` before every epoch, resumed ones included.
        """
        self._passes.set_epoch(epoch)
        current = self._pass
        if current is not None and current.remaining == 0:
            self._pass = None

    # ---- iteration -------------------------------------------------------------
    def __iter__(self) -> _Batches:
        """This rank's batches of the next epoch.  The pass starts at the first
        ``next()``: an iterator made and dropped unused takes no epoch."""
        if self._pass is not None:
            self._pass.finished = True  # abandoned, or over
        self._pass = None
        return _Batches(self)

    def _begin(self) -> tuple[Pass, EpochPlan, int]:
        start = self._passes.next_start()
        topo = self.topology()
        plan = self._plan(start.epoch, start.position, topo.world_size)
        current = self._passes.begin(
            Pass.epoch_of(start, plan.rank_batches(topo.rank), plan.consumed_after, plan.end)
        )
        self._pass, self._current_plan, self._current_rank = current, plan, topo.rank
        if self.num_samples == 0:
            warnings.warn(
                "evenly: BatchSampler has num_samples=0, so every rank yields 0 batches",
                EvenlyWarning,
                stacklevel=4,
            )
        elif plan.num_padded:
            warnings.warn(f"evenly: {plan.describe()}", EvenlyWarning, stacklevel=4)
        elif uneven := uneven_batches(plan):
            warnings.warn(uneven, EvenlyWarning, stacklevel=4)
        return current, plan, topo.rank

    # ---- checkpoints -----------------------------------------------------------
    def fingerprint(self) -> dict[str, Any]:
        """What a state must agree on (the same fields as ``evenly.Dataset``'s)."""
        return {
            "num_samples": self.num_samples,
            "seed": self.seed,
            "shuffle": "global" if self.shuffle else "none",
            "drop_last": self.drop_last,
            "pad": self.pad,
        }

    def state_dict(self, batches_received: int | None = None) -> dict[str, Any]:
        """Where the epoch stands, as a small JSON-serialisable dict.

        ``batches_received`` is the number of batches the training loop has received in
        the pass in progress.  It may be left out between passes, and under torchdata's
        ``StatefulDataLoader`` (which asks at the right moment, right after handing each
        batch out).  Otherwise a sampler cannot know what the loop received (a plain
        DataLoader with workers draws batches ahead of it), so a default call in the
        middle of a pass raises ``StateError`` naming the argument.  All ranks give the
        same state once they received the same number of batches: save rank 0's.

        >>> import json
        >>> sampler = BatchSampler(10, batch_size=3, shuffle=False, rank=0, world_size=1)
        >>> it = iter(sampler); _ = next(it); _ = next(it)
        >>> state = sampler.state_dict(batches_received=2)
        >>> state["epoch"], state["position"]
        (0, 6)
        >>> other = BatchSampler(10, batch_size=2, shuffle=False, rank=0, world_size=1)
        >>> other.load_state_dict(json.loads(json.dumps(state)))
        >>> list(other)
        [[6, 7], [8, 9]]
        """
        current = self._pass
        if current is None:
            if batches_received:
                raise ValueError(
                    f"batches_received={batches_received}, but no pass is in progress: the "
                    f"next one (epoch {self.epoch}) has not started"
                )
            return self._passes.next_start().to_dict(self.fingerprint())
        unconfirmed = batches_received is None and self._snapshot != (current, current.received)
        received = current.received if batches_received is None else batches_received
        received = check_int("batches_received", received, minimum=0)
        if current.total is not None and received > current.total:
            raise ValueError(
                f"batches_received={received}, but rank {self._current_rank} has only "
                f"{current.total} batch(es) in this pass of epoch {current.start.epoch}"
            )
        if received == current.total:  # the pass is over: point at the next one
            state = self._passes.next_start().to_dict(self.fingerprint())
        else:
            state = current.locate(received).to_dict(self.fingerprint())
        if unconfirmed:  # see _Batches: confirmed at once under StatefulDataLoader, or refused
            self._unconfirmed = (current, current.received)
            state[_UNCONFIRMED] = True
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Make the next ``iter()`` continue ``state`` exactly, under any world size or
        batch size; later ``iter()`` calls go on with the following epochs.

        Raises ``evenly.StateError`` naming every field that does not match this sampler.
        """
        state = dict(state)
        self._pending = bool(state.pop(_UNCONFIRMED, False))
        self._passes.load(PassState.from_dict(state, self.fingerprint()))
        self._pass = None

    def _check_counted(self, current: Pass | None) -> None:
        """Refuse to go on from (or past) a state that counted batches handed out."""
        if self._pending:
            raise StateError(
                "evenly: this BatchSampler state was saved by state_dict() without "
                "batches_received in the middle of a pass, so it counts the batches the "
                "sampler handed out, which a DataLoader with workers draws ahead of the "
                "loop: resuming from it could skip data. Save it with state_dict("
                "batches_received=<the batches your loop received in the epoch>), or use "
                "torchdata's StatefulDataLoader (it asks the sampler as it hands out a batch)"
            )
        if current is not None and self._unconfirmed[0] is current:
            raise StateError(
                f"evenly: BatchSampler.state_dict() was called without batches_received "
                f"after {self._unconfirmed[1]} batch(es) of epoch {current.start.epoch} "
                f"were handed out, and the loader drew more: a DataLoader with workers draws "
                f"batches ahead of the loop, so that state may count batches the loop never "
                f"received. Call state_dict(batches_received=<the batches your loop received "
                f"in this epoch>), or use torchdata's StatefulDataLoader"
            )


#: the key a default mid-pass state carries until StatefulDataLoader confirms it
_UNCONFIRMED = "batches_unconfirmed"


def _generate(current: Pass, plan: EpochPlan, rank: int) -> Iterator[list[int]]:
    """The pass's batches, computed a chunk of ``CHUNK`` positions at a time."""
    total = plan.rank_batches(rank)
    last = plan.rank_samples(rank) - (total - 1) * plan.batch_size if total else 0
    per = max(1, CHUNK // plan.batch_size)
    for first in range(0, total, per):
        stop = min(first + per, total)
        positions = plan.batches_positions(rank, np.arange(first, stop))
        flat: list[int] = plan.indices(positions).tolist()
        offset = 0
        for b in range(first, stop):
            size = last if b == total - 1 else plan.batch_size
            batch = flat[offset : offset + size]
            offset += size
            current.received += 1
            yield batch
    current.finished = True


class _Batches(Iterator[list[int]]):
    """One pass of a :class:`BatchSampler`, started by its first ``next()``.

    Its own small state is for ``StatefulDataLoader``, which saves it beside the
    sampler's and, on a restore, draws from a restored iterator before it knows the
    saved pass had ended: an iterator restored from a pass that was over yields nothing
    and takes no epoch, so the loader's next ``iter()`` starts the right one.
    """

    def __init__(self, sampler: BatchSampler) -> None:
        self._sampler = sampler
        self._pass: Pass | None = None
        self._batches: Iterator[list[int]] = iter(())
        self._over = False

    def __iter__(self) -> _Batches:
        return self

    def __next__(self) -> list[int]:
        self._sampler._check_counted(self._pass)
        if self._pass is None:
            if self._over:
                raise StopIteration
            self._pass, plan, rank = self._sampler._begin()
            self._batches = _generate(self._pass, plan, rank)
        return next(self._batches)

    def state_dict(self) -> dict[str, Any]:
        """``{"pass_over": True}`` once every batch of the pass has been drawn.

        ``StatefulDataLoader`` calls it right after handing each batch out, then the
        sampler's own ``state_dict()``: that is the moment the sampler's count of the
        batches handed out is the count the loop will have received, so it is marked.
        """
        sampler = self._sampler
        if self._pass is not None:
            sampler._snapshot = (self._pass, self._pass.received)
            if sampler._unconfirmed == sampler._snapshot:  # asked together: StatefulDataLoader
                sampler._unconfirmed = (None, -1)
        done = self._pass is not None and self._pass.remaining == 0
        return {"pass_over": done or self._over}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore an iterator that has not started: a pass that was over stays over.

        StatefulDataLoader restores it right after the sampler: the sampler's state,
        taken together with this one, was exact.
        """
        if self._pass is None:
            self._sampler._pending = False
            self._over = bool(state.get("pass_over", False))
