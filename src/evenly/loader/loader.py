"""``evenly.DataLoader``: a torch DataLoader that owns its passes: it plans batches with
the dataset, hands whole collated batches over from the workers, advances the epoch by
itself and knows how much of the epoch the training loop has received.

It keeps every torch DataLoader attribute a framework reads (``dataset``,
``batch_size``, ``collate_fn``, ``num_workers`` ...), so a loader rebuilt from them (as
Accelerate's ``prepare()`` does) gets the user's settings; the iteration itself runs on
a private torch DataLoader over a feed that yields one collated batch per plan batch.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import torch.distributed
import torch.utils.data
from torch.utils.data import default_collate, default_convert

from evenly.core.plan import EpochPlan
from evenly.core.spec import PassSpec
from evenly.dataset import _SKIP_SLOTS, STAMPS, Dataset
from evenly.errors import EvenlyWarning, check_int
from evenly.loader.feed import NO_LENGTH, Feed, Pass, PassIterator, pass_through, settle
from evenly.runtime import torch_compat
from evenly.runtime.agreement import DEFAULT_TIMEOUT, check_agreement, group_ranks
from evenly.runtime.channel import PassChannel
from evenly.runtime.checks import warn_about
from evenly.transport.slots import Transport

__all__ = ["DataLoader"]


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _refuse_planned_source(dataset: Dataset[Any]) -> None:
    """A source that plans its own epochs (an ``evenly.Mix``) lays its steps out from each
    epoch's start, which a stream of epochs does not keep: refused until it can."""
    if getattr(dataset.source, "epoch_order", None) is not None:
        raise ValueError(
            f"evenly.DataLoader(infinite=True) does not support a "
            f"{type(dataset.source).__name__} source yet: its per-step proportions and its "
            f"resume are defined per epoch, and a stream of epochs would silently repeat or "
            f"skip samples; train a Mix epoch by epoch (infinite=False)"
        )


class DataLoader(torch.utils.data.DataLoader[Any]):
    """A ``torch.utils.data.DataLoader`` for ``evenly.Dataset``.

    It owns its passes: it tells the plan its batch size, so whole batches are dealt to
    workers and the rank's batches come out as a map-style DataLoader would give them (at
    most one partial batch per epoch); workers read and collate a whole batch and hand it
    over as one item; it passes ``drop_last`` to the plan (an explicit value here wins
    over the dataset's); and every ``iter(loader)`` starts the next epoch, with or
    without ``persistent_workers`` (which defaults to ``True`` when ``num_workers > 0``:
    workers are forked once rather than every epoch; they are restarted if the dataset's
    source or transform changes between epochs).

    >>> import evenly
    >>> ds = evenly.Dataset(list(range(10)), shuffle=True, rank=0, world_size=1)
    >>> loader = evenly.DataLoader(ds, batch_size=4)
    >>> len(loader), [len(b) for b in loader]
    (3, [4, 4, 2])
    >>> loader.set_epoch(0)          # replay epoch 0 exactly
    >>> loader.epoch
    0

    ``len(loader)`` is the number of batches this rank yields in the epoch in progress
    (or the next one), counting, after ``load_state_dict``, the batches the interrupted
    run had already received in that epoch; ``loader.remaining_batches`` is what is left.

    Args:
        check_plan: at each pass split over the data-parallel group, check that every
            rank agrees on the plan (raising ``evenly.PlanMismatchError`` on all ranks).
        agreement_timeout: seconds to wait for the other ranks at that check.
        columnar: read batches column by column with the source's ``read_columns`` (no
            per-sample Python objects).  ``None`` (default): when the source says its
            columns equal ``default_collate``'s output, there is no transform and the
            collate is the default.  ``True``: always (the source must support it).
        infinite: train by steps: one endless pass over consecutive epochs, every batch
            full (a batch may span an epoch boundary), each epoch still read exactly once
            and every rank getting the same batches count; ``state_dict()`` resumes
            exactly by step under any topology.  ``len()`` is then undefined.
        transport: how workers hand batches to the main process.  ``"slots"``
            (default): each worker copies a batch's tensors and numpy arrays into one of
            a few shared-memory slots it reuses, and the main process copies them out
            (no new shared-memory segment and file descriptor per batch, as torch's
            hand-off needs; batches come out in ordinary memory, contiguous, pinned by
            ``pin_memory=True`` as usual).  ``"torch"``: torch's own hand-off.

    >>> loader = evenly.DataLoader(evenly.Dataset(list(range(5))), batch_size=2,
    ...                            infinite=True)
    >>> it = iter(loader)
    >>> [next(it).tolist() for _ in range(4)], loader.epoch
    ([[0, 1], [2, 3], [4, 0], [1, 2]], 1)
    """

    dataset: Dataset[Any]
    #: HF Accelerate's prepare() keeps this loader as it is (instead of rebuilding a
    #: loader from ``loader.dataset``, which would shard the data twice) ...
    _is_accelerate_prepared = True
    #: ... and its save_state()/load_state() save and load ``loader.state_dict()``.
    use_stateful_dataloader = True

    def __init__(
        self,
        dataset: Dataset[Any],
        batch_size: int | None = 1,
        num_workers: int = 0,
        drop_last: bool | None = None,
        *,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        check_plan: bool = True,
        agreement_timeout: float = DEFAULT_TIMEOUT,
        columnar: bool | None = None,
        infinite: bool = False,
        transport: str = "slots",
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
        if kwargs.get("in_order", True) is False:
            raise ValueError(
                "evenly.DataLoader: in_order=False lets batches arrive out of order, so what "
                "the loop received would not be a prefix of the epoch and a checkpoint would "
                "skip and repeat samples on resume; remove in_order=False (workers already "
                "read whole batches in parallel)"
            )
        if transport not in ("slots", "torch"):
            raise ValueError(f"transport must be 'slots' or 'torch', got {transport!r}")
        self.transport = transport
        if infinite and batch_size is None:
            raise ValueError("evenly.DataLoader(infinite=True) needs a batch_size")
        if infinite:
            _refuse_planned_source(dataset)
        self.infinite = bool(infinite)
        if agreement_timeout <= 0:
            raise ValueError(f"agreement_timeout must be > 0 seconds, got {agreement_timeout}")
        effective_drop = dataset.drop_last if drop_last is None else bool(drop_last)
        # workers are forked once, not every epoch (faster epochs; and a process with
        # communication threads, as under DDP, forks as rarely as possible)
        kwargs.setdefault("persistent_workers", num_workers > 0)
        super().__init__(
            dataset,
            batch_size=batch_size,
            num_workers=num_workers,
            drop_last=effective_drop,
            collate_fn=collate_fn,
            **kwargs,
        )
        self._plan_batch = 1 if batch_size is None else batch_size
        self._drop = effective_drop
        self.check_plan = check_plan
        self.agreement_timeout = float(agreement_timeout)
        self._channel = PassChannel()
        self._skipped = torch.zeros(_SKIP_SLOTS, dtype=torch.int64).share_memory_()  # type: ignore[no-untyped-call]
        batched = batch_size is not None
        self._feed = Feed(
            dataset,
            self._channel,
            collate=(collate_fn or default_collate) if batched else None,
            per_sample=None if batched else (collate_fn or default_convert),
            skipped=self._skipped,
        )
        self._columnar_choice = columnar
        self._user_collate = collate_fn
        engine_args = {k: v for k, v in kwargs.items() if k not in ("shuffle", "sampler")}
        self._engine = torch.utils.data.DataLoader(
            self._feed,
            batch_size=None,
            num_workers=num_workers,
            collate_fn=pass_through,
            **engine_args,
        )
        #: (stamp, epoch, start, batches received before) of the next pass, if set
        self._next: tuple[int, int, int, int] | None = None
        #: the stamp of the last dataset.set_epoch call this loader followed
        self._followed = dataset.epoch_request[0] if dataset.epoch_request else 0
        self._last_epoch: int | None = None
        self._last_num_samples: int | None = None
        self._pass: Pass | None = None
        #: stream position an infinite loader's next pass continues from
        self._stream_next = 0
        self._pass_iterator: weakref.ref[PassIterator] | None = None
        #: (len, fingerprint, generation) of the dataset when the workers started
        self._workers_view: tuple[int, int, int] | None = None

    # ---- epochs ----------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Make the next pass epoch ``epoch`` (reproduced exactly); later passes follow it.
        A pass in progress is not affected; a loaded state of that same epoch keeps its
        position (frameworks call ``set_epoch`` on the resumed epoch too)."""
        epoch = check_int("epoch", epoch, minimum=0)
        if self._next is not None and self._next[1] == epoch and self._next[2] > 0:
            return
        self._next = (next(STAMPS), epoch, 0, 0)

    @property
    def epoch(self) -> int:
        """The epoch of the pass in progress, or of the next pass if none is in progress."""
        if self._pass is not None and self._pass.stream is not None:
            stream = self._pass.stream
            return stream.consumed_after(self._pass.received) // stream.num_samples
        if not self._idle():
            assert self._pass is not None
            return self._pass.plan.epoch
        return self._peek_next()[0]

    def _idle(self) -> bool:
        return self._pass is None or self._pass.finished

    def _peek_next(self) -> tuple[int, int, int]:
        """(epoch, start, batches received before) of the next pass: the latest of this
        loader's set_epoch/load_state_dict and the dataset's set_epoch, else the epoch
        after the last pass."""
        request = self.dataset.epoch_request
        if request is not None and request[0] > self._followed:
            # a framework calling dataset.set_epoch(e) for the epoch a loaded state resumes
            # keeps the loaded position (Accelerate calls it every epoch, resumed or not)
            nxt = self._next
            keeps_loaded = nxt is not None and nxt[1] == request[1] and nxt[2] > 0
            if not keeps_loaded and (nxt is None or request[0] > nxt[0]):
                return request[1], 0, 0
        if self._next is not None:
            return self._next[1:]
        return (0 if self._last_epoch is None else self._last_epoch + 1), 0, 0

    def _spec(self, epoch: int, start: int) -> PassSpec:
        topo = self.dataset.topology()
        n = len(self.dataset.source)  # a pass is planned over the length it has then
        return PassSpec(
            epoch=epoch,
            start=min(start, n),
            num_samples=n,
            batch_size=self._plan_batch,
            drop_last=self._drop,
            rank=topo.rank,
            world_size=topo.world_size,
            handoff=True,
            generation=self.dataset.generation,
        )

    @property
    def plan(self) -> EpochPlan:
        """The plan of the pass in progress (or of the next one): padding, drops, sizes."""
        if not self._idle():
            assert self._pass is not None
            return self._pass.plan
        epoch, start, _ = self._peek_next()
        return self.dataset.plan_for(self._spec(epoch, start))

    def __len__(self) -> int:
        if self.infinite:
            raise TypeError(NO_LENGTH)
        if not self._idle():
            assert self._pass is not None
            return self._pass.prior + self._pass.plan.num_batches
        return self._peek_next()[2] + self.plan.num_batches

    @property
    def remaining_batches(self) -> int:
        """Batches this rank has still to receive in the pass in progress (or the next)."""
        if self.infinite:
            raise TypeError(NO_LENGTH)
        if not self._idle():
            assert self._pass is not None
            return self._pass.plan.num_batches - self._pass.received
        return self.plan.num_batches

    @property
    def num_skipped(self) -> int:
        """Samples replaced in the current pass under ``on_error="skip"`` (this rank)."""
        return int(self._skipped.sum())

    def _warn_skipped(self, plan: EpochPlan) -> None:
        skipped = self.num_skipped
        if skipped:
            warnings.warn(
                f"evenly: on_error='skip' replaced {skipped} unreadable sample(s) in epoch "
                f"{plan.epoch} on this rank with other samples, so every rank kept its "
                f"{plan.num_batches} batches; each is logged by the 'evenly' logger",
                EvenlyWarning,
                stacklevel=3,
            )

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
        >>> state["epoch"], state["position"], state["batches"]
        (0, 4, 2)
        >>> fresh = evenly.DataLoader(evenly.Dataset(list(range(10))), batch_size=5)
        >>> fresh.load_state_dict(json.loads(json.dumps(state)))
        >>> len(fresh), fresh.remaining_batches
        (4, 2)
        >>> [batch.tolist() for batch in fresh]
        [[4, 5, 6, 7, 8], [9]]
        """
        if self.infinite:
            current = self._pass
            if current is None or current.stream is None or self._stream_request():
                # where the next iter() starts: a set_epoch / loaded state, or the start
                epoch, position, _ = self._peek_next()
                return self.dataset.state_at(
                    epoch, position, len(self.dataset.source) + 1, 0, self._drop
                )
            stream = current.stream
            epoch, position = divmod(stream.consumed_after(current.received), stream.num_samples)
            return self.dataset.state_at(epoch, position, stream.num_samples + 1, 0, self._drop)
        if self._idle():
            epoch, position, prior = self._peek_next()
            end = len(self.dataset.source) + 1  # never "over" before it starts
            return self.dataset.state_at(epoch, position, end, prior, self._drop)
        assert self._pass is not None
        plan, done = self._pass.plan, self._pass.received
        return self.dataset.state_at(
            plan.epoch, plan.consumed_after(done), plan.end, self._pass.prior + done, self._drop
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Make the next pass resume ``state`` exactly: under any number of ranks, workers
        or batch size, with persistent workers running or not.  Later passes continue
        with the following epochs.  Raises ``evenly.StateError`` on a mismatch.
        """
        epoch, position, batches = self.dataset.check_state(state, self._drop)
        self._next = (next(STAMPS), epoch, position, batches if position else 0)
        self._pass = None

    # ---- passes ----------------------------------------------------------------
    def _workers_stale(self, view: tuple[int, int, int]) -> bool:
        """Persistent workers hold the dataset as it was when they started: restart them
        when its length, source fingerprint or generation changed since."""
        running = torch_compat.running_iterator(self._engine)
        stale = running is not None and self._workers_view not in (None, view)
        if stale:
            settle(running, shut_down=False)
            torch_compat.shut_down_workers(running)
            torch_compat.drop_iterator(self._engine)
        return stale

    def _use_columns(self) -> bool:
        if self._columnar_choice is False or self.batch_size is None:
            return False
        source = self.dataset.source
        if self._columnar_choice is True:
            if not hasattr(source, "read_columns"):
                raise TypeError(
                    f"evenly.DataLoader(columnar=True): {type(source).__name__} has no "
                    f"read_columns(); use an Arrow-backed source (evenly.from_arrow, "
                    f"from_parquet) or columnar=None"
                )
            return True
        return (
            bool(getattr(source, "columnar_exact", False))
            and self.dataset.transform is None
            and self._user_collate in (None, default_collate)
        )

    def __iter__(self) -> PassIterator:  # type: ignore[override]
        if self.infinite:
            return self._iter_stream()
        epoch, start, prior = self._peek_next()
        self._next = None
        if self.dataset.epoch_request is not None:
            self._followed = self.dataset.epoch_request[0]
        spec = self._spec(epoch, start)
        plan = self.dataset.plan_for(spec)
        warn_about(plan, self.num_workers, spec.rank)
        if self._last_num_samples not in (None, spec.num_samples):
            warnings.warn(
                f"evenly: the source had {self._last_num_samples} samples last epoch and has "
                f"{spec.num_samples} now; epoch {epoch} is planned over the new length",
                EvenlyWarning,
                stacklevel=2,
            )
        self._last_num_samples = spec.num_samples
        self._last_epoch = epoch
        return self._start(spec, Pass(plan, prior if start else 0))

    def _start(self, spec: PassSpec, current: Pass) -> PassIterator:
        """Publish the pass to the workers (restarting persistent ones that hold a stale
        dataset) and start iterating the private loader."""
        previous = self._pass_iterator() if self._pass_iterator is not None else None
        if previous is not None:  # the previous pass, finished or abandoned
            settle(previous.inner, shut_down=True)
        view = (spec.num_samples, self.dataset.source_fingerprint(), spec.generation)
        self._workers_stale(view)
        if torch_compat.running_iterator(self._engine) is None:
            self._workers_view = view
        if self.num_workers > 0 and (
            torch_compat.running_iterator(self._engine) is None or not self.persistent_workers
        ):
            self._new_transport()
        self._feed.columnar = self._use_columns()
        self._skipped.zero_()
        self._channel.publish(spec)
        self._pass = current
        # workers fork before the agreement exchange, never right after a collective: a
        # process forked while a gloo thread is finishing a collective can hang in os.fork
        iterator = PassIterator(iter(self._engine), current, self._warn_skipped)
        self._pass_iterator = weakref.ref(iterator)  # a weak one: do not keep workers alive
        self._check_agreement(current.plan, spec)
        return iterator

    def _new_transport(self) -> None:
        """Fresh slots for workers about to start (the old ones' are dropped)."""
        if self._feed.transport is not None:
            self._feed.transport.close()
            self._feed.transport = None
        if self.transport == "slots":
            prefetch = self.prefetch_factor or 2
            self._feed.transport = Transport(self.num_workers, slots=prefetch + 1)

    def _stream_request(self) -> bool:
        """Whether a set_epoch or a loaded state (not the stream so far) says where an
        infinite loader's next pass starts."""
        request = self.dataset.epoch_request
        return self._next is not None or (request is not None and request[0] > self._followed)

    def _iter_stream(self) -> PassIterator:
        """One endless pass over consecutive epochs (``infinite=True``), continuing from
        what the loop received so far, or from a loaded state / ``set_epoch``."""
        n = len(self.dataset.source)
        if n == 0:
            raise ValueError("evenly.DataLoader(infinite=True): the source is empty")
        _refuse_planned_source(self.dataset)
        if self._stream_request():
            epoch, start, _ = self._peek_next()
            self._stream_next = epoch * n + min(start, n)
        elif self._pass is not None and self._pass.stream is not None:
            self._stream_next = self._pass.stream.consumed_after(self._pass.received)
        self._next = None
        if self.dataset.epoch_request is not None:
            self._followed = self.dataset.epoch_request[0]
        topo = self.dataset.topology()
        spec = PassSpec(
            epoch=self._stream_next // n,
            start=self._stream_next,
            num_samples=n,
            batch_size=self._plan_batch,
            rank=topo.rank,
            world_size=topo.world_size,
            handoff=True,
            generation=self.dataset.generation,
            infinite=True,
        )
        epoch_plan = self.dataset.plan_for(replace(spec, start=0, infinite=False))
        return self._start(spec, Pass(epoch_plan, 0, self.dataset.stream_plan_for(spec)))

    def _check_agreement(self, plan: EpochPlan, spec: PassSpec) -> None:
        """Only a plan split over the data-parallel group must agree across it (a dataset
        built with world_size=1 on purpose, e.g. for evaluation, is not)."""
        if not (self.check_plan and _distributed()):
            return
        group = self.dataset.process_group
        if plan.world_size != len(group_ranks(group)):
            return
        view = {
            **self.dataset.fingerprint(self._drop),
            "batch_size": plan.batch_size,
            "epoch": plan.epoch,
            "start": spec.start,
            "infinite": spec.infinite,
            "world_size": plan.world_size,
            "rank": spec.rank,
        }
        check_agreement(view, group=group, timeout=self.agreement_timeout)
