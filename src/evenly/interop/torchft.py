"""torchft (fault tolerance without restarts): an ``evenly.Dataset`` read one committed
step at a time by the replica groups in the current quorum.

The epoch is a sequence of global batches: positions ``[P, P + G)`` of the epoch's order,
where ``P`` is the *committed* position (every global batch before it was in a step that
torchft committed) and ``G`` the global batch size.  At each step the data ranks of the
quorum (``manager.num_participants()`` replica groups x the ranks of one group) each take
their slice of that global batch, exactly as ``evenly.DataLoader`` deals one global step
(:class:`~evenly.core.plan.EpochPlan`).  When torchft commits the step (its step count
advances) ``P`` moves past the global batch; when it does not (``should_commit()`` was
false: a group died, an all-reduce failed) ``P`` stays, and the same global batch is dealt
again to the next step's quorum.  So every sample of the epoch is in exactly one
committed step, whoever left or joined.

The state is that committed position (a plain evenly state: epoch, position, the plan's
fingerprint), registered with the Manager's state-dict hooks: a healing group loads the
one its peer sends, and the same dict saved with the model resumes a restart of
everything, under any number of groups.  Reading happens in the calling process (no
DataLoader workers: the topology may change at every step).

This module never imports torchft: it uses the Manager it is given.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch.utils.data

from evenly.core.plan import EpochPlan
from evenly.core.spec import PassSpec
from evenly.core.state import PassState
from evenly.dataset import Dataset, planner_of
from evenly.errors import check_int

__all__ = ["FaultTolerantLoader"]

_log = logging.getLogger("evenly")

#: Where the loader's state lives in the Manager's state dict (``register_state_dict_fn``).
STATE_KEY = "evenly"


class Manager(Protocol):
    """What evenly uses of a ``torchft.Manager``."""

    def current_step(self) -> int: ...
    def participating_rank(self) -> int | None: ...
    def num_participants(self) -> int: ...
    def is_participating(self) -> bool: ...
    def register_state_dict_fn(
        self, key: str, load_state_dict: Callable[[Any], None], state_dict: Callable[[], Any]
    ) -> None: ...


@dataclass(frozen=True)
class _Dealt:
    """The global batch dealt at the step in progress."""

    step: int  # the manager's step count when it was dealt
    epoch: int
    after: int  # the committed position once this step commits
    end: int  # the epoch's end: at ``after >= end`` the epoch is complete
    world: int  # the data ranks it was dealt to
    part: Any = None  # a Mix's part of the state at ``after`` (None: a plain source)


@dataclass
class _Reading:
    """A pass read from ``next_position`` on under one topology: while the steps commit
    and the quorum stays, each step's slice is the next batch of this reader."""

    key: tuple[int, int, int, int, int]  # epoch, world, rank, per-rank batch, generation
    next_position: int
    batches: Iterator[Any]


class FaultTolerantLoader:
    """This replica group's slice of each step's global batch under a ``torchft.Manager``.

    Every sample of the epoch is in exactly one committed step (up to the epoch's
    reported padding), whatever groups leave or join: see docs/elastic.md, "torchft".
    The loader registers its state with ``manager`` (key ``"evenly"``), so a healing
    group resumes from its peer's committed position.

    Take each step's batch *after* the step's quorum started (``optimizer.zero_grad()``
    of torchft's ``OptimizerWrapper``, or ``manager.start_quorum()``)::

        while loader.epoch < epochs:
            batches = iter(loader)               # the rest of the epoch
            while True:
                optimizer.zero_grad()            # torchft: this step's quorum
                batch = next(batches, None)      # this group's slice of the global batch
                if batch is None:                # every global batch of it committed
                    break
                loss_fn(model(batch)).backward()  # gradients all-reduced across groups
                optimizer.step()                 # committed or not: the loader follows

    Args:
        dataset: an ``evenly.Dataset`` (its topology is the replica group's own data
            ranks: one per group for DDP across groups).
        manager: the ``torchft.Manager`` of this replica group.  Its quorum must let
            every counted group train: ``use_async_quorum=False``, or ``init_sync=False``
            (under the defaults torchft discards the first step's gradients of every
            group but one, and that step's data with them; refused, naming this).
        global_batch_size: samples per step over all data ranks of the quorum.  A
            quorum whose number of data ranks does not divide it takes the largest
            multiple of that number below it per step (logged); the epoch stays exact.
        collate_fn: turns a list of samples into a batch (``default_collate``).
    """

    def __init__(
        self,
        dataset: Dataset[Any],
        manager: Manager,
        *,
        global_batch_size: int,
        collate_fn: Callable[[list[Any]], Any] | None = None,
    ) -> None:
        if not isinstance(dataset, Dataset):
            raise TypeError(
                f"FaultTolerantLoader needs an evenly.Dataset, got {type(dataset).__name__}; "
                f"wrap it: FaultTolerantLoader(evenly.Dataset(your_data), manager, ...)"
            )
        planner = planner_of(dataset)
        if planner.pad == "none":
            raise ValueError(
                "FaultTolerantLoader cannot use pad='none': every group takes part in every "
                "step's all-reduce, so every group needs a batch in the epoch's last step; "
                "use pad='repeat' (the default) or pad='mask' to mark the repeats"
            )
        self.dataset = dataset
        self.manager = manager
        self.global_batch_size = check_int("global_batch_size", global_batch_size, minimum=1)
        self._planner = planner
        self._collate = torch.utils.data.default_collate if collate_fn is None else collate_fn
        self._lock = threading.Lock()  # the Manager reads the state from its quorum thread
        self._epoch = 0
        self._position = 0  # committed positions of ``_epoch``
        #: a Mix's part of the state at the committed position (how the epoch was dealt
        #: so far, so that the rest is apportioned on), and what a loaded state fixed for
        #: later epochs; None for any other source
        self._part: Any = None
        self._anchor: Any = None
        self._dealt: _Dealt | None = None
        self._quorum: object = None  # the quorum the last batch was dealt under
        self._reading: _Reading | None = None
        self._warned: set[int] = set()
        #: whether this group's last batch counts (False: a spare batch, for a group that
        #: heals while the others step; torchft discards its gradients)
        self.participating = False
        try:
            manager.register_state_dict_fn(STATE_KEY, self.load_state_dict, self.state_dict)
        except AssertionError:  # torchft asserts that a key is registered once
            raise ValueError(
                f"FaultTolerantLoader: this Manager already holds a state named "
                f"{STATE_KEY!r} (another FaultTolerantLoader): one loader per Manager"
            ) from None

    # ---- where the epoch stands --------------------------------------------------
    def _committed(self) -> tuple[int, int, Any]:
        """(epoch, position, a Mix's part) as committed now: the step in progress counts
        once the manager's step count has moved past the one it was dealt at."""
        dealt = self._dealt
        if dealt is not None and self.manager.current_step() > dealt.step:
            if dealt.after >= dealt.end:
                return dealt.epoch + 1, 0, self._anchor
            return dealt.epoch, dealt.after, dealt.part
        return self._epoch, self._position, self._part

    def _settle(self) -> None:
        with self._lock:
            self._epoch, self._position, self._part = self._committed()
            self._dealt = None

    @property
    def epoch(self) -> int:
        """The epoch in progress (all of its global batches not yet committed)."""
        with self._lock:
            return self._committed()[0]

    # ---- checkpoints -------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The committed position as an evenly state (JSON-serialisable), the same on
        every group once they committed the same steps; torchft sends it to a healing
        group.  ``evenly.DataLoader.load_state_dict`` takes it too."""
        with self._lock:
            epoch, position, part = self._committed()
            step = self.manager.current_step()
        state = self._planner.to_state(PassState(epoch, position, source=part))
        state["torchft"] = {"step": step, "global_batch_size": self.global_batch_size}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``'s committed position (a peer's, when torchft heals
        this group; or a checkpoint's, or any evenly state).  ``evenly.StateError`` if
        it belongs to another dataset."""
        loaded = self._planner.from_state(state)
        extra = state.get("torchft")
        with self._lock:
            self._epoch, self._position = loaded.epoch, loaded.position
            self._part, self._anchor = loaded.source, self._planner.carried(loaded)
            self._reading = None
            dealt = self._dealt
            if dealt is not None:
                # healing while the others step (async quorum): this step deals the
                # global batch at the loaded position, and commits it with them
                step = extra.get("step") if isinstance(extra, dict) else None
                plan = self._plan(loaded.epoch, loaded.position, dealt.world, 0)
                after = plan.consumed_after(1)
                self._dealt = _Dealt(
                    dealt.step if step is None else int(step),
                    loaded.epoch,
                    after,
                    plan.end,
                    dealt.world,
                    self._part_at(loaded.epoch, after, plan),
                )

    # ---- steps -------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        """This group's batch of every step until the epoch in progress is committed."""
        epoch = self.epoch
        while True:
            batch = self._next(epoch)
            if batch is None:
                return
            yield batch[0]

    def _per_rank(self, world: int) -> int:
        per_rank = self.global_batch_size // world
        if per_rank == 0:
            raise ValueError(
                f"FaultTolerantLoader(global_batch_size={self.global_batch_size}) is smaller "
                f"than the quorum's {world} data ranks: every rank needs at least one "
                f"sample per step; raise global_batch_size to at least the most ranks the "
                f"job runs on"
            )
        if self.global_batch_size % world and world not in self._warned:
            self._warned.add(world)
            _log.warning(
                "evenly: global_batch_size=%d does not split over %d data ranks: the steps "
                "under this quorum take %d samples (%d per rank)",
                self.global_batch_size,
                world,
                per_rank * world,
                per_rank,
            )
        return per_rank

    def _part_at(self, epoch: int, position: int, plan: EpochPlan) -> Any:
        """A Mix's part of the state at ``position``, reached by ``plan`` (how the epoch
        was dealt up to there); None for any other source."""
        if self._planner.view.planned is None or position >= plan.end:
            return None
        saved = self._planner.to_state(
            PassState(epoch, position, source=self._part), order=plan.order
        )
        return self._planner.from_state(saved).source

    def _spec(self, epoch: int, position: int, world: int, rank: int) -> PassSpec:
        return PassSpec(
            epoch=epoch,
            start=position,
            num_samples=self._planner.num_samples(),
            batch_size=self._per_rank(world),
            drop_last=self._planner.drop_last,
            rank=rank,
            world_size=world,
            handoff=True,
            generation=self._planner.generation,
            source=self._part,
        )

    def _plan(self, epoch: int, position: int, world: int, rank: int) -> EpochPlan:
        return self._planner.plan_for(self._spec(epoch, position, world, rank))

    def _fresh_quorum(self) -> object:
        """The quorum of the step in progress; raise if none was started since the last
        batch (a batch taken before ``zero_grad()`` would be dealt to the last step's
        quorum, and a group that left since would take its slice with it)."""
        if not hasattr(self.manager, "_quorum_future"):
            raise TypeError(
                f"evenly FaultTolerantLoader: this Manager ({type(self.manager).__name__}) has "
                f"no _quorum_future, which evenly reads to tell a step's quorum from the last "
                f"one (torchft 0.2's Manager has it; constraints.txt pins the tested version)"
            )
        quorum = self.manager._quorum_future
        if quorum is None or quorum is self._quorum:
            raise RuntimeError(
                "evenly FaultTolerantLoader: take each step's batch after the step's quorum "
                "started: call optimizer.zero_grad() (torchft's OptimizerWrapper) or "
                "manager.start_quorum() first, then next(batches) (a `for batch in loader` "
                "loop takes the batch before zero_grad(); see docs/elastic.md, torchft)"
            )
        return quorum

    def _next(self, epoch: int) -> tuple[Any] | None:
        """This group's slice of the next uncommitted global batch of ``epoch`` (None
        when ``epoch`` is complete)."""
        quorum = self._fresh_quorum()
        group = self.manager.participating_rank()  # waits for the quorum
        groups = self.manager.num_participants()
        if group is not None and not self.manager.is_participating():
            raise RuntimeError(
                "evenly FaultTolerantLoader: torchft counts this replica group in the step "
                "but discards its gradients (it heals at step 0 under use_async_quorum=True "
                "and init_sync=True), so its slice of the first global batch would never be "
                "trained; create the Manager with init_sync=False (every group initialises "
                "its model from the same seed) or use_async_quorum=False"
            )
        self._settle()
        with self._lock:
            if self._epoch != epoch:
                return None
            position = self._position
        local = self.dataset.topology()  # this group's own data ranks
        world = groups * local.world_size
        rank = (0 if group is None else group) * local.world_size + local.rank
        spec = self._spec(epoch, position, world, rank)
        plan = self._planner.plan_for(spec)
        if plan.num_batches == 0:  # drop_last: what is left does not fill a step
            with self._lock:
                self._epoch, self._position, self._part = epoch + 1, 0, self._anchor
            return None
        if plan.has_partial_batch() or plan.num_padded:
            _log.info("evenly: epoch %d's last step: %s", epoch, plan.describe())
        batch = self._read(spec, plan)
        after = plan.consumed_after(1)
        part = self._part_at(epoch, after, plan)
        with self._lock:
            self._dealt = _Dealt(self.manager.current_step(), epoch, after, plan.end, world, part)
        self._quorum = quorum
        self.participating = group is not None
        return (batch,)

    def _read(self, spec: PassSpec, plan: EpochPlan) -> Any:
        """The first batch of ``spec``'s pass for its rank, continuing the pass read so
        far when this step follows the last one under the same topology."""
        key = (spec.epoch, spec.world_size, spec.rank, spec.batch_size, spec.generation)
        reading = self._reading
        if reading is None or reading.key != key or reading.next_position != spec.start:
            self._planner.check_files()
            batches = self._planner.read(spec, 0, 1, collate=self._collate)
            reading = self._reading = _Reading(key, spec.start, batches)
        batch = next(reading.batches)
        reading.next_position = plan.consumed_after(1)
        return batch
