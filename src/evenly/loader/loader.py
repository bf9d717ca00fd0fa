"""``evenly.DataLoader``: a torch DataLoader that owns its passes: it plans batches with
the dataset, hands whole collated batches over from the workers, advances the epoch by
itself and knows how much of the epoch the training loop has received.

It keeps every torch DataLoader attribute a framework reads, so a loader rebuilt from
them gets the user's settings; the iteration runs on a private loader (``engine``).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed
import torch.utils.data

from evenly.core.passes import Pass, PassOwner, PassTracker
from evenly.core.plan import EpochPlan
from evenly.core.spec import PassSpec
from evenly.core.state import PassState
from evenly.core.stream import StreamPlan
from evenly.dataset import SKIP_SLOTS, Dataset, planner_of
from evenly.errors import EvenlyWarning, check_int, check_timeout, warn_deprecated
from evenly.loader import mixing
from evenly.loader.choices import check_worker_type, use_columns, use_threads
from evenly.loader.delegated import after_delegated, plan_delegation
from evenly.loader.engine import Engine
from evenly.loader.feed import NO_LENGTH, PassIterator
from evenly.loader.stats import LoaderStats, StatsLog
from evenly.options import TRANSPORTS, Transport, WorkerType
from evenly.runtime import hooks
from evenly.runtime.agreement import DEFAULT_TIMEOUT, check_pass
from evenly.runtime.checks import warn_about, warn_skipped
from evenly.runtime.delegation import Delegation

__all__ = ["DataLoader", "per_rank_batch"]

_log = logging.getLogger("evenly")


def _agreement_timeout(timeout: float | None, check_plan: bool | None) -> float | None:
    """The one plan-agreement setting: seconds, or ``None`` (off); the deprecated
    ``check_plan=False`` is ``None``."""
    if check_plan is not None:
        warn_deprecated(
            "evenly.DataLoader(check_plan=...)",
            "agreement_timeout=None to switch the plan agreement off "
            "(a number: the seconds it waits for the other ranks)",
            stacklevel=3,
        )
        if not check_plan:
            return None
    return check_timeout("evenly.DataLoader(agreement_timeout=...)", timeout)


def per_rank_batch(global_batch_size: int, batch_size: int | None, world_size: int) -> int:
    """The per-rank batch size that keeps ``global_batch_size`` samples per step on
    ``world_size`` ranks (``batch_size``: what was also given, 1 being the default)."""
    check_int("global_batch_size", global_batch_size, minimum=1)
    if global_batch_size % world_size:
        fits = [w for w in range(1, global_batch_size + 1) if global_batch_size % w == 0]
        raise ValueError(
            f"evenly.DataLoader(global_batch_size={global_batch_size}) cannot be split over "
            f"world_size={world_size} ranks: it must be a multiple of the world size "
            f"(world sizes that divide it: {fits[:12]}{' ...' if len(fits) > 12 else ''}); "
            f"choose a global batch size that every world size of the job divides, or give "
            f"batch_size= (per rank) instead"
        )
    per_rank = global_batch_size // world_size
    if batch_size not in (None, 1, per_rank):
        raise ValueError(
            f"evenly.DataLoader: batch_size={batch_size} and global_batch_size="
            f"{global_batch_size} disagree on world_size={world_size} (per rank: "
            f"{per_rank}); give one of them"
        )
    return per_rank


class DataLoader(PassOwner, torch.utils.data.DataLoader[Any]):
    """A ``torch.utils.data.DataLoader`` for ``evenly.Dataset``.

    It owns its passes: whole batches are planned and dealt to workers (at most one
    partial batch per epoch), read and collated there and handed over as one item; an
    explicit ``drop_last`` here wins over the dataset's; every ``iter(loader)`` starts
    the next epoch.  ``persistent_workers`` defaults to ``True`` (workers fork once; they
    are restarted if the dataset's source or transform changes between epochs).

    >>> import evenly
    >>> ds = evenly.Dataset(list(range(10)), shuffle=True, rank=0, world_size=1)
    >>> loader = evenly.DataLoader(ds, batch_size=4)
    >>> len(loader), [len(b) for b in loader]
    (3, [4, 4, 2])
    >>> loader.set_epoch(0)          # replay epoch 0 exactly
    >>> loader.epoch
    0

    ``len(loader)``: this rank's batches in the epoch in progress (or next), after
    ``load_state_dict`` counting those already received; ``remaining_batches``: the rest.

    Everything after ``batch_size`` is keyword-only.

    Args:
        agreement_timeout: at each pass split over the data-parallel group, every rank
            checks that all agree on the plan (raising ``evenly.PlanMismatchError`` on
            all ranks), waiting at most this many seconds for the others (default 30).
            ``None`` switches the check off (a loader built on some ranks only).
        check_plan: deprecated: ``check_plan=False`` is ``agreement_timeout=None``.
        columnar: read batches column by column (``read_columns``: no per-sample
            objects).  ``None`` (default): where that equals ``default_collate``'s output
            and there is no transform.  ``True``: always (the source must support it).
        infinite: train by steps: one endless pass over consecutive epochs, every batch
            full (one may span an epoch boundary), each epoch read exactly once;
            ``state_dict()`` resumes by step under any topology; no ``len()``.
        transport: how workers hand batches over.  ``"slots"`` (default): through
            shared-memory slots whose tensors the loop gets as views (zero-copy; past 8
            held batches per worker, copies).  ``"copy"``: the slots, copied out.
            ``"torch"``: torch's own hand-off.  See docs/guide.md.
        worker_type: who reads the ``num_workers`` shares.  ``"process"``: worker
            processes.  ``"thread"``: reader threads in this process, each over its
            own copy of the source (same batches, same order; for reads that release
            the GIL; refused with per-sample seeding of the global generators or a
            ``worker_init_fn``).  ``"auto"`` (default): threads for columnar passes
            and packed passes over a token-reading source with no transform, where
            safe; processes otherwise.
        global_batch_size: opt-in: the samples of one step over all ranks, kept when
            the world size changes (an elastic restart): the per-rank ``batch_size`` is
            ``global_batch_size // world_size`` (logged), and a world size that does not
            divide it is refused with the sizes that do.  A checkpoint resumes exactly
            onto another world size either way (docs/elastic.md).

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
        *,
        num_workers: int = 0,
        drop_last: bool | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        agreement_timeout: float | None = DEFAULT_TIMEOUT,
        columnar: bool | None = None,
        infinite: bool = False,
        transport: Transport = "slots",
        worker_type: WorkerType = "auto",
        check_plan: bool | None = None,
        global_batch_size: int | None = None,
        **kwargs: Any,
    ) -> None:
        if not isinstance(dataset, Dataset):
            raise TypeError(
                f"evenly.DataLoader needs an evenly.Dataset, got {type(dataset).__name__}; "
                f"wrap it: evenly.DataLoader(evenly.Dataset(your_data), ...)"
            )
        #: the samples of one step over all ranks, kept whatever the world size (opt-in)
        self.global_batch_size = global_batch_size
        if global_batch_size is not None:
            world = dataset.topology().world_size
            batch_size = per_rank_batch(global_batch_size, batch_size, world)
            _log.info(
                "evenly.DataLoader: global_batch_size=%d over %d ranks: batch_size=%d per rank",
                global_batch_size,
                world,
                batch_size,
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
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be 'slots', 'copy' or 'torch', got {transport!r}")
        self.transport = transport
        self.worker_type = check_worker_type(worker_type, kwargs)
        if infinite and batch_size is None:
            raise ValueError("evenly.DataLoader(infinite=True) needs a batch_size")
        if infinite:
            planner_of(dataset).check_stream()
        self.infinite = bool(infinite)
        timeout = _agreement_timeout(agreement_timeout, check_plan)
        effective_drop = dataset.drop_last if drop_last is None else bool(drop_last)
        # workers fork once, not every epoch (a process with DDP's threads forks rarely)
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
        #: seconds to wait for the other ranks at the plan agreement; ``None``: no check
        self.agreement_timeout = timeout
        self._skipped = torch.zeros(SKIP_SLOTS, dtype=torch.int64).share_memory_()  # type: ignore[no-untyped-call]
        # the dataset's planner (one object for the dataset's life; torch's DataLoader
        # does not let ``dataset`` be replaced): how this loader plans, reads, checkpoints
        self._planner = planner_of(dataset)
        self._engine = Engine(
            self._planner,
            batched=batch_size is not None,
            collate_fn=collate_fn,
            num_workers=num_workers,
            transport=transport,
            skipped=self._skipped,
            loader_args=kwargs,
        )
        self._loader_args = kwargs
        self._columnar_choice = columnar
        self._user_collate = collate_fn
        self._passes = PassTracker()
        dataset._adopt(self)
        #: the epoch a pass delegated to accelerate's SkipDataLoader consumed (-1: none)
        self._delegated = torch.full((1,), -1, dtype=torch.int64).share_memory_()  # type: ignore[no-untyped-call]
        self._followed = dataset._epoch_calls()[0]  # dataset.set_epoch calls seen
        self._last_num_samples: int | None = None
        self._warned_gather = False
        self._plan: EpochPlan | StreamPlan | None = None  # of the pass in progress or last
        self._stats = StatsLog()

    @property
    def check_plan(self) -> bool:
        """Deprecated: whether the plan agreement runs (``agreement_timeout is not None``)."""
        warn_deprecated("evenly.DataLoader.check_plan", "evenly.DataLoader.agreement_timeout")
        return self.agreement_timeout is not None

    @check_plan.setter
    def check_plan(self, value: bool) -> None:
        warn_deprecated(
            "evenly.DataLoader.check_plan", "agreement_timeout (None switches the check off)"
        )
        if not value:
            self.agreement_timeout = None
        elif self.agreement_timeout is None:
            self.agreement_timeout = DEFAULT_TIMEOUT

    def stats(self) -> LoaderStats:
        """Per pass: batches, samples/s, the loop's wait, the workers' time per stage,
        bytes and cache hits where the source reports them (:class:`evenly.LoaderStats`)."""
        return self._stats.snapshot()

    def _follow_dataset(self) -> None:
        """A ``dataset.set_epoch`` made since the last one this loader followed counts
        as this loader's own ``set_epoch`` (the later call wins)."""
        self._follow_set_epoch()
        after_delegated(self._passes, self._delegated)  # skip_first_batches ran one

    def _follow_set_epoch(self) -> None:
        calls, epoch = self.dataset._epoch_calls()
        if calls > self._followed:
            self._followed = calls
            self._passes.set_epoch(epoch)

    def _delegated_pass(self, k: int) -> Delegation:
        """This loader's pass as read through its dataset by a loader that drops its
        first ``k`` batches (HF Accelerate's ``skip_first_batches``): see
        :mod:`evenly.loader.delegated`."""
        self._follow_set_epoch()  # not the shared flag: a worker may have set it already
        return plan_delegation(
            self._planner, self._passes, self._spec, self._drop, self._delegated, k
        )

    def set_epoch(self, epoch: int) -> None:
        """Make the next pass epoch ``epoch`` (reproduced exactly); later passes follow it.
        A pass in progress is not affected; a loaded state of that same epoch keeps its
        position (frameworks call ``set_epoch`` on the resumed epoch too)."""
        self._follow_dataset()
        self._passes.set_epoch(epoch)

    @property
    def epoch(self) -> int:
        """The epoch of the pass in progress, or of the next pass if none is in progress."""
        self._follow_dataset()
        current = self._passes.current
        if current is not None:  # an epoch's pass is its epoch until it ends
            return current.state().epoch if current.endless else current.start.epoch
        return self._passes.next_start().epoch

    def _spec(self, start: PassState, infinite: bool = False) -> PassSpec:
        topo = self.dataset.topology()
        n = self._planner.num_samples()  # a pass is planned over the length it has
        return PassSpec(
            epoch=start.epoch,
            start=self._planner.pass_start(start.epoch, start.position, infinite),
            num_samples=n,
            batch_size=self._plan_batch,
            drop_last=self._drop and not infinite,
            rank=topo.rank,
            world_size=topo.world_size,
            handoff=True,
            generation=self._planner.generation,
            infinite=infinite,
            source=start.source,
        )

    @property
    def plan(self) -> EpochPlan:
        """The plan of the pass in progress (or of the next one): padding, drops, sizes."""
        if self._passes.current is not None and isinstance(self._plan, EpochPlan):
            return self._plan
        self._follow_dataset()
        return self._planner.plan_for(self._spec(self._passes.next_start()))

    # ---- the pass owner's contract (len(), remaining_batches: core.passes) ----------
    def _running(self) -> Pass | None:
        return self._passes.current

    def _next_start(self) -> PassState:
        self._follow_dataset()
        return self._passes.next_start()

    def _pass_rank(self) -> int:
        return self.dataset.topology().rank

    def _check_length(self) -> None:
        if self.infinite:
            raise TypeError(NO_LENGTH)

    @property
    def num_skipped(self) -> int:
        """Samples replaced in the current pass under ``on_error="skip"`` (this rank)."""
        return int(self._skipped.sum())

    def _warn_skipped(self, plan: EpochPlan) -> None:
        warn_skipped(self.num_skipped, plan)

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
        self._follow_dataset()
        state = self._passes.state()
        if self.infinite:
            state = PassState(state.epoch, state.position)
        running = self._passes.current is not None and isinstance(self._plan, EpochPlan)
        order = self._plan.order if running and isinstance(self._plan, EpochPlan) else None
        return self._planner.to_state(state, self._drop, order)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Make the next pass resume ``state`` exactly: under any number of ranks, workers
        or batch size, with persistent workers running or not.  Later passes continue
        with the following epochs.  Raises ``evenly.StateError`` on a mismatch.
        """
        loaded = self._planner.from_state(state, self._drop)
        self._follow_dataset()
        self._passes.load(loaded, self._planner.carried(loaded))

    def set_weights(self, weights: Mapping[str, float]) -> None:
        """An ``evenly.Mix``'s new weights, from the next batch this loader yields.

        The rest of the epoch follows them, each source's stream continuing (once
        before twice); later epochs keep them.  Mid-pass, the pass restarts where the
        loop stands (prefetched batches are read again); the state records the change,
        so a fresh loader with the original weights resumes exactly.  Under DDP every
        rank calls it after the same batch (``PlanMismatchError`` otherwise).  See
        docs/mixtures.md, "Weights that change during training".

        >>> import evenly
        >>> mix = evenly.Mix({"a": list(range(100)), "b": list(range(100, 200))},
        ...                  weights={"a": 1, "b": 1}, samples_per_epoch=40)
        >>> loader = evenly.DataLoader(evenly.Dataset(mix, shuffle=True), batch_size=4)
        >>> it = iter(loader); first = [next(it) for _ in range(5)]   # 20 at 1:1
        >>> loader.set_weights({"a": 3, "b": 1})                      # 20 more at 3:1
        >>> sum(int(x) < 100 for b in it for x in b)
        15
        """
        if self.infinite:
            raise ValueError(
                "set_weights is not supported under evenly.DataLoader(infinite=True): a "
                "stream of epochs keeps the weights it started with (a Mix by samples is "
                "not streamed at all); train epoch by epoch to change them"
            )
        self._follow_dataset()
        running = mixing.reweight(self._planner, self._passes, self._plan, self._drop, weights)
        held = self._engine.iterating()
        if running and held is not None:
            held.adopt(iter(self))  # the loop goes on with the restarted pass
            self._engine.follow(held)

    # ---- passes ----------------------------------------------------------------
    def __iter__(self) -> PassIterator:  # type: ignore[override]
        self._follow_dataset()
        if self.infinite:
            return self._iter_stream()
        start = self._passes.next_start()
        spec = self._spec(start)
        plan = self._planner.plan_for(spec)
        warn_about(plan, self.num_workers, spec.rank)
        for adapter in () if self._warned_gather else hooks.registered():  # once per loader
            self._warned_gather = adapter.warn_padded(plan, self.dataset.pad)
            if self._warned_gather:
                break
        if self._last_num_samples not in (None, spec.num_samples):
            warnings.warn(
                f"evenly: the source had {self._last_num_samples} samples last epoch and has "
                f"{spec.num_samples} now; epoch {spec.epoch} is planned over the new length",
                EvenlyWarning,
                stacklevel=2,
            )
        self._last_num_samples = spec.num_samples
        current = Pass.epoch_of(
            PassState(spec.epoch, spec.start, start.batches, start.source),
            plan.rank_batches(spec.rank),
            plan.consumed_after,
            plan.end,
        )
        iterator = self._start(spec, plan, current)
        iterator.epoch_end = hooks.watch_pass(plan, self.dataset.pad, iterator)
        return iterator

    def _iter_stream(self) -> PassIterator:
        """One endless pass over consecutive epochs (``infinite=True``), continuing from
        what the loop received so far, or from a loaded state / ``set_epoch``."""
        n = self._planner.units(self._passes.next_start().epoch)  # best_fit: plans it
        if n == 0:
            raise ValueError("evenly.DataLoader(infinite=True): the source is empty")
        self._planner.check_stream()
        spec = self._spec(self._passes.next_start(), infinite=True)
        stream = self._planner.stream_plan_for(spec)

        def locate(received: int) -> PassState:
            return PassState(*stream.locate(stream.consumed_after(received)))

        return self._start(spec, stream, Pass(locate(0), None, locate))

    def _start(self, spec: PassSpec, plan: EpochPlan | StreamPlan, current: Pass) -> PassIterator:
        """Start the pass on the engine, then check that the ranks agree on it."""
        retried = self._planner.check_files()  # raised here, in the main process
        self._skipped.zero_()
        self._passes.begin(current)
        self._plan = plan
        # workers fork before the agreement, never right after a collective (may hang)
        columnar = use_columns(
            self._columnar_choice, self.batch_size, self._planner, self._user_collate
        )
        reads = self._planner.pass_strategy(columnar)  # this pass's reader, chosen once
        threads = use_threads(
            self.worker_type, self.num_workers, self._planner, reads, self._loader_args
        )
        iterator = self._engine.start(
            spec,
            plan,
            current,
            reads=reads,
            on_end=self._warn_skipped if isinstance(plan, EpochPlan) else None,
            threads=threads,
        )
        iterator.recorder = self._stats.begin(spec.epoch)
        iterator.recorder.count(retried)
        if self.agreement_timeout is not None:
            check_pass(
                spec,
                self._planner.fingerprint(self._drop),
                group=self.dataset.process_group,
                timeout=self.agreement_timeout,
            )
        return iterator
