"""The pass tracker: where the next pass of one owner starts, and how far the pass in
progress has come.  One for every owner of passes (``evenly.DataLoader``,
``evenly.BatchSampler``, the dataset's own passes in one process), so that the rules are
written once:

- ``set_epoch(e)`` makes the next pass epoch ``e`` from its start, unless the next pass
  is a loaded state of that very epoch (frameworks call ``set_epoch`` on the resumed
  epoch too): then the loaded position is kept;
- ``load(state)`` makes the next pass continue ``state``;
- without either, the next pass is the one after the last pass (the next epoch, or for
  an endless pass, where the loop stopped);
- a pass counts what was handed to the caller, never what was prefetched.

Pure Python: no torch, no I/O.

>>> tracker = PassTracker()
>>> current = tracker.begin(Pass.epoch_of(tracker.next_start(), batches=3,
...                                       locate=lambda k: k * 10, end=30))
>>> current.received = 1
>>> tracker.state()
PassState(epoch=0, position=10, batches=1)
>>> tracker.load(tracker.state()); tracker.set_epoch(0)   # keeps the loaded position
>>> tracker.next_start()
PassState(epoch=0, position=10, batches=1)
>>> tracker.set_epoch(4); tracker.next_start()
PassState(epoch=4, position=0, batches=0)
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from evenly.core.state import PassState
from evenly.errors import check_int

__all__ = ["Pass", "PassOwner", "PassTracker", "after_set_epoch"]


def after_set_epoch(pending: PassState | None, loaded: bool, epoch: int) -> PassState:
    """The next pass after ``set_epoch(epoch)``, given the pass already due (``pending``,
    ``loaded`` if it came from a checkpoint): the one place this rule is written."""
    epoch = check_int("epoch", epoch, minimum=0)
    if loaded and pending is not None and pending.epoch == epoch and pending.resumes:
        return pending
    return PassState(epoch)


class Pass:
    """A pass that has started: where it started, this rank's batches in it (``None``:
    endless), and the batches handed to the caller so far.

    ``locate(k)`` is the state after ``k`` batches received; ``after()`` where the next
    pass starts by default (the next epoch; for an endless pass, where it stands).
    """

    __slots__ = ("_locate", "endless", "finished", "received", "start", "total")

    def __init__(
        self,
        start: PassState,
        total: int | None,
        locate: Callable[[int], PassState],
    ) -> None:
        self.start = start
        self.total = total
        self.endless = total is None
        self._locate = locate
        self.received = 0
        self.finished = False

    @classmethod
    def epoch_of(
        cls, start: PassState, batches: int, locate: Callable[[int], int], end: int
    ) -> Pass:
        """A pass over (the rest of) one epoch: ``batches`` for this rank, ``locate(k)``
        the epoch position after ``k`` of them; from position ``end`` on, the state is
        the next epoch's start."""
        prior = start.batches if start.resumes else 0

        def state_after(k: int) -> PassState:
            position = locate(k)
            if position >= end or k >= batches:
                return PassState(start.epoch + 1, source=start.source)
            return PassState(start.epoch, position, prior + k, start.source)

        begun = PassState(start.epoch, start.position, prior, start.source)
        return cls(begun, batches, state_after)

    @property
    def prior(self) -> int:
        """Batches this rank had received in the epoch before the pass started."""
        return self.start.batches

    @property
    def remaining(self) -> int:
        """Batches still to hand over (an endless pass has no end)."""
        if self.total is None:
            raise TypeError("an endless pass has no remaining batches")
        return self.total - self.received

    def state(self) -> PassState:
        """Where the pass stands: the state after the batches received so far."""
        return self._locate(self.received)

    def locate(self, received: int) -> PassState:
        """The state after ``received`` batches of this pass."""
        return self._locate(received)

    def after(self) -> PassState:
        """Where the next pass starts when nothing else was asked for."""
        if self.endless:
            return self.state()
        return PassState(self.start.epoch + 1)


class PassTracker:
    """The passes of one owner: the next one (asked for, or the default) and the one in
    progress."""

    __slots__ = ("_anchor", "_current", "_loaded", "_pending")

    def __init__(self) -> None:
        self._pending: PassState | None = None
        self._loaded = False
        self._current: Pass | None = None
        #: what a loaded state's source part fixed for every later pass (a Mix's streams)
        self._anchor: Any = None

    def set_epoch(self, epoch: int) -> None:
        """The next pass is epoch ``epoch`` from its start (a loaded state of that epoch
        keeps its position).  A pass in progress is not affected."""
        self._pending = after_set_epoch(self._pending, self._loaded, epoch)
        self._loaded = self._loaded and self._pending.resumes

    def load(self, state: PassState, carried: Any = None) -> None:
        """The next pass continues ``state``; a pass in progress is dropped.  ``carried``:
        what of its source part holds for every later pass too."""
        self._pending = state
        self._loaded = True
        self._current = None
        self._anchor = carried

    @property
    def requested(self) -> bool:
        """Whether ``set_epoch`` or ``load`` says where the next pass starts."""
        return self._pending is not None

    def next_start(self) -> PassState:
        """Where the next pass starts (with what a loaded state fixed for it)."""
        if self._pending is not None:
            state = self._pending
        elif self._current is not None:
            state = self._current.after()
        else:
            state = PassState()
        if state.source is None and self._anchor is not None:
            state = PassState(state.epoch, state.position, state.batches, self._anchor)
        return state

    def begin(self, current: Pass) -> Pass:
        """Start ``current`` (built from ``next_start()``): the request is used up."""
        self._pending = None
        self._loaded = False
        self._current = current
        return current

    @property
    def current(self) -> Pass | None:
        """The pass in progress (``None`` when none is, or the last one finished)."""
        current = self._current
        return None if current is None or current.finished else current

    @property
    def last(self) -> Pass | None:
        """The pass in progress or the last one, finished or not."""
        return self._current

    def state(self) -> PassState:
        """Where the owner stands: in the pass in progress, else where the next starts.
        An endless pass gives way to a ``set_epoch``/``load`` (training by steps starts
        a new iterator there); a pass over one epoch is finished first."""
        current = self.current
        if current is not None and not (current.endless and self.requested):
            return current.state()
        return self.next_start()


class PassOwner(ABC):
    """The contract of every object that runs passes over an epoch plan and is driven by
    a training loop (``evenly.DataLoader``, ``evenly.BatchSampler``), as torchdata's
    ``BaseNode``: ``set_epoch`` / ``epoch`` / ``state_dict`` / ``load_state_dict``, and
    the batch counts written once here:

    - ``len()``: this rank's batches in the epoch of the pass in progress (or the next
      one); after ``load_state_dict`` it counts the batches received before the
      checkpoint too (what Lightning's restored batch counter and ``StatefulDataLoader``
      expect);
    - ``remaining_batches``: what the pass still yields.

    An owner says which pass is in progress, where the next one starts, its rank and its
    plan; nothing else reaches into it.
    """

    @abstractmethod
    def _running(self) -> Pass | None:
        """The pass in progress, or ``None``."""

    @abstractmethod
    def _next_start(self) -> PassState:
        """Where the next pass starts."""

    @abstractmethod
    def _pass_rank(self) -> int:
        """This rank, resolved now."""

    @property
    @abstractmethod
    def plan(self) -> Any:
        """The plan of the pass in progress (or of the next one)."""

    @property
    @abstractmethod
    def epoch(self) -> int:
        """The epoch of the pass in progress, or of the next one."""

    @abstractmethod
    def set_epoch(self, epoch: int) -> None:
        """Make the next pass epoch ``epoch`` (reproduced exactly)."""

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """Where the owner stands, for a checkpoint."""

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Make the next pass continue ``state``."""

    def _check_length(self) -> None:
        """Raise ``TypeError`` where the passes have no length (endless ones)."""
        return None

    def __len__(self) -> int:
        self._check_length()
        current = self._running()
        if current is not None and current.total is not None:
            return current.prior + current.total
        start = self._next_start()
        return (start.batches if start.resumes else 0) + int(
            self.plan.rank_batches(self._pass_rank())
        )

    @property
    def remaining_batches(self) -> int:
        """Batches this rank has still to receive in the pass in progress (or the next)."""
        self._check_length()
        current = self._running()
        if current is not None:
            return current.remaining
        return int(self.plan.rank_batches(self._pass_rank()))
