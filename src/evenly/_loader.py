"""``evenly.DataLoader``: a torch DataLoader that plans batches with the dataset, advances the
epoch by itself and knows how much of the epoch the training loop has received."""

from __future__ import annotations

import time
import warnings
import weakref
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import torch.distributed
import torch.utils.data

from ._agreement import check_agreement
from ._dataset import Dataset, EvenlyWarning, warn_about
from ._plan import EpochPlan, check_int

__all__ = ["DataLoader"]


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def warn_skipped(dataset: Dataset[Any], plan: EpochPlan) -> None:
    """At the end of a pass, report samples replaced under on_error="skip"."""
    skipped = dataset.num_skipped
    if skipped:
        warnings.warn(
            f"evenly: on_error='skip' replaced {skipped} unreadable sample(s) in epoch "
            f"{plan.epoch} on this rank with other samples, so every rank kept its "
            f"{plan.num_batches} batches; each is logged by the 'evenly' logger",
            EvenlyWarning,
            stacklevel=3,
        )


def settle(inner: Any, shut_down: bool = False) -> None:
    """Wait until a finished torch iterator's queue feeder threads have exited.

    A Python thread that is exiting while the next epoch forks its workers can leave
    CPython's thread-state lock held in the child, which then hangs forever inside
    ``os.fork`` (seen with CPython 3.11: the new worker never starts, its rank waits for
    data and every other rank waits in a collective).  Torch closes those queues when
    an epoch ends but does not wait for their threads; evenly does, before any new fork.
    With ``shut_down``, an iterator abandoned mid-epoch is shut down first.
    """
    if shut_down and not getattr(inner, "_persistent_workers", True):
        shutdown = getattr(inner, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
    if not getattr(inner, "_shutdown", False):
        return
    for queue in getattr(inner, "_index_queues", []):
        thread = getattr(queue, "_thread", None)
        if thread is not None:
            thread.join(timeout=10)


def _dead_workers(iterator: Any, wait: float = 2.0) -> list[int]:
    """Pids of the iterator's workers that died (waiting briefly: a worker killed an
    instant ago closes its sockets a moment before it can be seen dead)."""
    workers = getattr(iterator, "_workers", [])
    deadline = time.monotonic() + wait
    while True:
        dead = [w.pid for w in workers if not w.is_alive()]
        if dead or not workers or time.monotonic() > deadline:
            return dead
        time.sleep(0.02)


class _Pass:
    """The pass in progress: its plan and how many batches the loop has received."""

    __slots__ = ("finished", "plan", "received")

    def __init__(self, plan: EpochPlan) -> None:
        self.plan = plan
        self.received = 0
        self.finished = False


class _PassIterator(Iterator[Any]):
    """Counts the batches handed to the training loop (not those prefetched)."""

    def __init__(self, inner: Iterator[Any], current: _Pass, dataset: Dataset[Any]) -> None:
        self._inner = inner
        self._pass = current
        self._dataset = dataset

    def __iter__(self) -> _PassIterator:
        return self

    def __next__(self) -> Any:
        try:
            batch = next(self._inner)
        except (ConnectionError, EOFError) as exc:
            # a worker that died while the main process fetched its batch's shared
            # memory surfaces as a bare connection error: name the worker instead
            dead = _dead_workers(self._inner)
            if dead:
                raise RuntimeError(
                    f"evenly: DataLoader worker(s) (pid {', '.join(map(str, dead))}) died "
                    f"while handing over a batch (killed by a signal or out of memory?)"
                ) from exc
            raise
        except StopIteration:
            if not self._pass.finished:
                self._pass.finished = True
                settle(self._inner)
                warn_skipped(self._dataset, self._pass.plan)
            raise
        self._pass.received += 1
        return batch

    def __len__(self) -> int:
        return self._pass.plan.num_batches


class DataLoader(torch.utils.data.DataLoader[Any]):
    """A ``torch.utils.data.DataLoader`` for ``evenly.Dataset``.

    It tells the dataset the batch size, so whole batches are dealt to workers and the
    rank's batches come out as a map-style DataLoader would give them (at most one
    partial batch per epoch); it passes ``drop_last`` to the plan (an explicit value here
    wins over the dataset's); and every ``iter(loader)`` starts the next epoch, with or
    without ``persistent_workers`` (which defaults to ``True`` when ``num_workers > 0``:
    workers are forked once rather than every epoch).

    >>> import evenly
    >>> ds = evenly.Dataset(list(range(10)), shuffle=True, rank=0, world_size=1)
    >>> loader = evenly.DataLoader(ds, batch_size=4)
    >>> len(loader), [len(b) for b in loader]
    (3, [4, 4, 2])
    >>> loader.set_epoch(0)          # replay epoch 0 exactly
    >>> loader.epoch
    0

    ``len(loader)`` is the number of batches this rank yields in the pass in progress, or
    in the next pass when none is in progress.
    """

    dataset: Dataset[Any]

    def __init__(
        self,
        dataset: Dataset[Any],
        batch_size: int | None = 1,
        num_workers: int = 0,
        drop_last: bool | None = None,
        *,
        check_plan: bool = True,
        **kwargs: Any,
    ) -> None:
        if not isinstance(dataset, Dataset):
            raise TypeError(
                f"evenly.DataLoader needs an evenly.Dataset, got {type(dataset).__name__}; "
                f"wrap it: evenly.DataLoader(evenly.Dataset(your_data), ...)"
            )
        if batch_size is not None:
            check_int("batch_size", batch_size, minimum=1)
        check_int("num_workers", num_workers, minimum=0)
        effective_drop = dataset.drop_last if drop_last is None else bool(drop_last)
        # workers are forked once, not every epoch (faster epochs; and a process with
        # communication threads, as under DDP, forks as rarely as possible)
        kwargs.setdefault("persistent_workers", num_workers > 0)
        self._plan_batch = 1 if batch_size is None else batch_size
        self._drop = effective_drop
        super().__init__(
            dataset,
            batch_size=batch_size,
            num_workers=num_workers,
            drop_last=effective_drop,
            **kwargs,
        )
        dataset._configure(batch_size=self._plan_batch, drop_last=effective_drop)
        dataset._loader_managed = True
        self._last_epoch: int | None = None
        self._last_num_samples: int | None = None
        self._pass: _Pass | None = None
        self._pass_iterator: weakref.ref[_PassIterator] | None = None
        #: Check at each epoch that all DDP ranks agree on the plan (one collective).
        self.check_plan = check_plan

    # ---- epochs ----------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Make the next pass epoch ``epoch`` (reproduced exactly); later passes follow it."""
        self.dataset.set_epoch(epoch)

    @property
    def epoch(self) -> int:
        """The epoch of the pass in progress, or of the next pass if none is in progress."""
        return self._next_pass()[0] if self._idle() else self.dataset.epoch

    def _idle(self) -> bool:
        return self._pass is None or self._pass.finished

    def _next_pass(self) -> tuple[int, int]:
        if self.dataset._pending is not None:
            return self.dataset._pending
        return (0 if self._last_epoch is None else self._last_epoch + 1), 0

    @property
    def plan(self) -> EpochPlan:
        """The plan of the pass in progress (or of the next one): padding, drops, sizes."""
        if not self._idle():
            assert self._pass is not None
            return self._pass.plan
        epoch, start = self._next_pass()
        current = self.dataset.plan()
        n = len(self.dataset.source)  # the next pass is planned over the length it has then
        return replace(
            current,
            num_samples=n,
            world_size=self.dataset.topology().world_size,
            batch_size=self._plan_batch,
            drop_last=self._drop,
            epoch=epoch,
            start=min(start, n),
        )

    def __len__(self) -> int:
        return self.plan.num_batches

    # ---- checkpoints -----------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Where training stands, as a small JSON-serialisable dict.

        It counts the batches the training loop has *received* (batches that workers
        prefetched are not consumed), as a prefix of the epoch's global order, so it is
        the same on every rank once all ranks have received the same number of batches:
        save rank 0's with the model.  Taken after a pass ends, it points at the start of
        the next epoch.

        >>> import evenly, json
        >>> loader = evenly.DataLoader(evenly.Dataset(list(range(10))), batch_size=2)
        >>> it = iter(loader); _ = next(it); _ = next(it)
        >>> state = loader.state_dict()
        >>> state["epoch"], state["position"]
        (0, 4)
        >>> fresh = evenly.DataLoader(evenly.Dataset(list(range(10))), batch_size=5)
        >>> fresh.load_state_dict(json.loads(json.dumps(state)))
        >>> [batch.tolist() for batch in fresh]
        [[4, 5, 6, 7, 8], [9]]
        """
        if self._idle():
            epoch, position = self._next_pass()
            end = self.dataset.fingerprint()["num_samples"] + 1  # never "over" before it starts
            return self.dataset._state_at(epoch, position, end)
        assert self._pass is not None
        plan = self._pass.plan
        return self.dataset._state_at(
            plan.epoch, plan.consumed_after(self._pass.received), plan.end
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Make the next pass resume ``state`` exactly: under any number of ranks, workers
        or batch size, with persistent workers running or not.  Later passes continue
        with the following epochs.  Raises ``evenly.StateError`` on a mismatch.
        """
        self.dataset._configure(batch_size=self._plan_batch, drop_last=self._drop)
        self.dataset.load_state_dict(state)
        self._pass = None

    def __iter__(self) -> _PassIterator:  # type: ignore[override]
        epoch, start = self._next_pass()
        self.dataset._pending = None
        self.dataset._configure(batch_size=self._plan_batch, drop_last=self._drop)
        plan = self.dataset._begin_pass(epoch, start)
        warn_about(plan, self.num_workers, self.dataset._current_rank())
        if self._last_num_samples not in (None, plan.num_samples):
            warnings.warn(
                f"evenly: the source had {self._last_num_samples} samples last epoch and has "
                f"{plan.num_samples} now; epoch {epoch} is planned over the new length",
                EvenlyWarning,
                stacklevel=2,
            )
        self._last_num_samples = plan.num_samples
        self._last_epoch = epoch
        self._pass = _Pass(plan)
        previous = self._pass_iterator() if self._pass_iterator is not None else None
        if previous is not None:  # the previous pass, finished or abandoned
            settle(previous._inner, shut_down=True)
        # workers fork before the agreement collective, never right after it: a process
        # forked while a gloo thread is finishing a collective can hang in os.fork
        iterator = _PassIterator(super().__iter__(), self._pass, self.dataset)
        self._pass_iterator = weakref.ref(iterator)  # a weak one: do not keep workers alive
        # only a plan split over the process group's ranks must agree across it (a
        # dataset built with world_size=1 on purpose, e.g. for evaluation, is not)
        if (
            self.check_plan
            and _distributed()
            and plan.world_size == torch.distributed.get_world_size()
        ):
            check_agreement(self._view(plan))
        return iterator

    def _view(self, plan: EpochPlan) -> dict[str, Any]:
        """This rank's view of the plan, for the agreement check."""
        return {
            **self.dataset.fingerprint(),
            "batch_size": plan.batch_size,
            "epoch": plan.epoch,
            "start": plan.start,
            "world_size": plan.world_size,
            "rank": self.dataset._current_rank(),
        }
