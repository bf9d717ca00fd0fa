"""``evenly.Dataset``: an IterableDataset over any sized, indexable source that reads each
sample exactly once per epoch across DDP ranks and DataLoader workers.

The dataset reads its share of a pass described by a :class:`~evenly.core.spec.PassSpec`.
Under ``evenly.DataLoader`` the loader owns the pass (and its batch size); under any
other loader (a plain torch DataLoader, one that Accelerate or Lightning rebuilt,
StatefulDataLoader) the dataset owns it: its topology is fixed in the main process (at
the latest when it is pickled for the workers), ``set_epoch`` marks a pass start, and
every further pass of a worker is the next epoch.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

import torch
from torch.utils.data import IterableDataset, get_worker_info

from evenly.core.order import make_order
from evenly.core.plan import EpochPlan, Order
from evenly.core.source import Source
from evenly.core.spec import PassSpec
from evenly.core.stream import StreamPlan
from evenly.core.topology import Topology
from evenly.errors import check_int
from evenly.interop.accelerate import Wrapped, before_pass, check_pass, driving, len_asked, under
from evenly.runtime.channel import PassCounter
from evenly.runtime.checkpoints import Checkpoints
from evenly.runtime.checks import check_current, check_source, shuffle_mode, warn_about
from evenly.runtime.detect import group_of, is_detected_from_environment, resolve_topology
from evenly.runtime.reader import ReadContext, read_batches
from evenly.runtime.seeds import GENERATORS, check_generators

__all__ = ["Dataset"]

T_co = TypeVar("T_co", covariant=True)

#: Stamps ordering set_epoch / load_state_dict calls on datasets and loaders.
STAMPS = itertools.count(1)
#: Per-worker counters of samples replaced under on_error="skip".
_SKIP_SLOTS = 64
_UNSET = -1


class Dataset(Checkpoints, IterableDataset[Any], Generic[T_co]):
    """An iterable dataset that shards, shuffles and batches correctly.

    Each epoch every sample is read exactly once across all ranks and workers (up to the
    reported padding), the shuffle is one global permutation per ``(seed, epoch)``, and
    every rank yields the same number of samples and batches.

    >>> import evenly
    >>> ds = evenly.Dataset(list(range(10)), shuffle=True, seed=1, rank=0, world_size=2)
    >>> loader = evenly.DataLoader(ds, batch_size=4, num_workers=0)
    >>> len(ds), len(loader)
    (5, 2)
    >>> first = [int(x) for batch in loader for x in batch]
    >>> second = [int(x) for batch in loader for x in batch]   # the next epoch, reshuffled
    >>> first != second
    True

    Args:
        source: the samples: a list, numpy array, map-style torch Dataset, HF Dataset, or
            a sharded file source (``evenly.from_parquet`` ...).
        shuffle: ``False``; ``"global"`` (one permutation of all samples per epoch);
            ``"block"`` (sharded sources: shard order permuted per epoch, uniform shuffle
            inside windows of ``block_shards`` shards); ``True`` takes the source's
            preferred mode: "block" for remote shards, else "global" (logged once).
        seed: the seed of the shuffle and of the per-sample random streams.
        drop_last: drop the epoch's remainder instead of padding it (see ``EpochPlan``).
        transform: called on each sample after the generators in ``seed_generators`` were
            seeded from (seed, epoch, the sample's global position).
        seed_generators: which global generators to seed per sample: any of ``"random"``,
            ``"numpy"``, ``"torch"`` (default: all three).  ``()`` seeds none: build your
            own generator from :func:`evenly.sample_seed` inside the transform.
        rank, world_size: override what is detected.
        process_group: the data-parallel group (a torch ProcessGroup or a DeviceMesh
            dimension): rank and world size are taken within it, the plan agreement runs
            in it, and ranks outside it with the same group rank (tensor/pipeline peers of
            one replica) get identical batches.
        block_shards: shards per shuffle window in ``"block"`` mode.
        on_error: ``"raise"`` (default): a sample the source cannot read raises, naming
            it; ``"skip"``: it is replaced by another sample (so every rank keeps its
            batch count), logged, counted in ``num_skipped`` and reported at epoch end.
    """

    _source: Source[T_co]

    def __init__(
        self,
        source: Source[T_co],
        *,
        shuffle: bool | str = False,
        seed: int = 0,
        drop_last: bool = False,
        transform: Callable[[Any], Any] | None = None,
        seed_generators: tuple[str, ...] | list[str] = GENERATORS,
        rank: int | None = None,
        world_size: int | None = None,
        process_group: Any = None,
        block_shards: int = 8,
        on_error: str = "raise",
    ) -> None:
        check_source(source)
        self._generation = 0
        self._source = source
        self._transform = transform
        self.shuffle_mode = shuffle_mode(shuffle, source)
        self.block_shards = check_int("block_shards", block_shards, minimum=1)
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
        self.on_error = on_error
        self.seed = check_int("seed", seed)
        self.drop_last = bool(drop_last)
        self.seed_generators = check_generators(seed_generators)
        self._rank = None if rank is None else check_int("rank", rank, minimum=0)
        self._world_size = (
            None if world_size is None else check_int("world_size", world_size, minimum=1)
        )
        self.process_group = group_of(process_group)
        if self._rank is not None and self._world_size is not None:
            Topology(self._rank, self._world_size)
        #: the topology as fixed in the main process (None until it can be detected)
        self._fixed: Topology | None = None
        self._counter = PassCounter()
        #: what the main process saw last (len, fingerprint, generation), for workers
        self._seen = torch.tensor([_UNSET, 0, 0], dtype=torch.int64).share_memory_()  # type: ignore[no-untyped-call]
        self._skipped = torch.zeros(_SKIP_SLOTS, dtype=torch.int64).share_memory_()  # type: ignore[no-untyped-call]
        #: samples this process's iterator has handed out in the current pass
        self._progress = [0]
        #: samples the next pass of this process skips (a worker restored by
        #: StatefulDataLoader: what it had yielded of the interrupted pass)
        self._local_skip = 0
        #: (stamp, epoch) of the last set_epoch call, for an evenly.DataLoader to follow
        self.epoch_request: tuple[int, int] | None = None
        #: in a spawned worker's copy: how Accelerate drove the pass when it was pickled
        self._wrapped: Wrapped | None = None
        self.topology()
        self._note_main_view()

    # ---- what may change between passes ------------------------------------------
    @property
    def source(self) -> Source[T_co]:
        """The samples.  Replacing it starts a new generation: a DataLoader's persistent
        workers holding the old one raise instead of reading it (evenly.DataLoader
        restarts them)."""
        return self._source

    @source.setter
    def source(self, value: Source[T_co]) -> None:
        check_source(value)
        self._source = value
        self._new_generation()

    @property
    def transform(self) -> Callable[[Any], Any] | None:
        """The per-sample transform (replacing it starts a new generation, as ``source``)."""
        return self._transform

    @transform.setter
    def transform(self, value: Callable[[Any], Any] | None) -> None:
        self._transform = value
        self._new_generation()

    def _new_generation(self) -> None:
        self._generation += 1
        self._note_main_view()

    @property
    def generation(self) -> int:
        """How many times ``source`` or ``transform`` was replaced."""
        return self._generation

    def source_fingerprint(self) -> int:
        """A 63-bit digest of ``source.fingerprint`` (0 if the source has none)."""
        fp = getattr(self._source, "fingerprint", None)
        if not isinstance(fp, str):
            return 0
        return int.from_bytes(hashlib.blake2b(fp.encode(), digest_size=8).digest(), "little") >> 1

    def _note_main_view(self) -> None:
        """Record, for workers, the source length, fingerprint and generation seen now."""
        if get_worker_info() is None:
            self._seen[0] = len(self._source)
            self._seen[1] = self.source_fingerprint()
            self._seen[2] = self._generation

    # ---- topology ----------------------------------------------------------------
    def topology(self) -> Topology:
        """This process's data-parallel (rank, world_size): explicit, else the given
        process group, else torch.distributed, else torchrun's variables, else 0 of 1.

        In the main process it is resolved and fixed as soon as it can be detected; a
        DataLoader worker uses the value fixed in the main process (spawn/forkserver
        workers have no process group of their own).
        """
        if self._fixed is not None:
            return self._fixed
        explicit = self._rank is not None and self._world_size is not None
        if get_worker_info() is None and (
            explicit or is_detected_from_environment(self.process_group)
        ):
            self._fixed = resolve_topology(self._rank, self._world_size, self.process_group)
            return self._fixed
        return resolve_topology(self._rank, self._world_size, self.process_group)

    def __getstate__(self) -> dict[str, Any]:
        """Pickled for the workers (spawn/forkserver): fix the topology here, in the main
        process, and leave the process group object behind."""
        if get_worker_info() is None:
            self.topology()  # fixed here if it can be detected (else the copy resolves it)
            self._note_main_view()
        state = self.__dict__.copy()
        state["process_group"] = None
        state["_wrapped"] = driving(self, self._wrapped)
        return state

    # ---- the dataset's own passes (under a loader that is not evenly's) ------------
    @property
    def epoch(self) -> int:
        """The epoch of the dataset's own pass in progress (or of the next one)."""
        return self._counter.current()[0]

    def set_epoch(self, epoch: int) -> None:
        """Make the next pass epoch ``epoch``, from its start; later passes follow it.

        Under any loader the epoch advances by itself with every pass; call this to
        replay an epoch or to follow a framework's epoch counter (as with
        ``DistributedSampler``).  An ``evenly.DataLoader`` over this dataset follows the
        call too, unless its own ``set_epoch``/``load_state_dict`` came later.
        """
        epoch = check_int("epoch", epoch, minimum=0)
        if get_worker_info() is None:
            before_pass(self)
        self.epoch_request = (next(STAMPS), epoch)
        start = 0
        base = self._counter.base()
        if self._counter.started() == 0 and base[0] == epoch:
            start = base[1]  # a loaded state of this very epoch keeps its position
        self._counter.reset(epoch, start)
        self._skipped.zero_()
        self._note_main_view()
        self.topology()

    def _own_spec(
        self, worker_id: int, num_workers: int, count: bool, wrapped: Wrapped | None = None
    ) -> PassSpec:
        if count:
            epoch, start = self._counter.begin(worker_id, num_workers)
        else:
            epoch, start = self._counter.current()
        topo, batch = under(wrapped or driving(self, self._wrapped), self.topology())
        n = len(self._source)
        return PassSpec(
            epoch=epoch,
            start=min(start, n),
            num_samples=n,
            batch_size=batch,
            drop_last=self.drop_last,
            rank=topo.rank,
            world_size=topo.world_size,
            generation=self._generation,
        )

    def plan(self) -> EpochPlan:
        """The plan of the dataset's own pass in progress, or of the next one."""
        return self.plan_for(self._own_spec(0, 1, count=False))

    def plan_for(self, spec: PassSpec) -> EpochPlan:
        """The epoch plan a pass spec describes (the one code path that builds plans;
        ``stream_plan_for`` for an infinite pass)."""
        if spec.infinite:
            raise ValueError("an infinite pass has a stream plan: use stream_plan_for")
        return EpochPlan(
            num_samples=spec.num_samples,
            world_size=spec.world_size,
            batch_size=spec.batch_size,
            drop_last=spec.drop_last,
            seed=self.seed,
            epoch=spec.epoch,
            start=spec.start,
            order=self.order_for(
                spec.epoch, spec.num_samples, spec.world_size * spec.batch_size, spec.start
            ),
        )

    def stream_plan_for(self, spec: PassSpec) -> StreamPlan:
        """The endless plan over consecutive epochs of an infinite pass."""
        step = spec.world_size * spec.batch_size
        return StreamPlan(
            num_samples=spec.num_samples,
            world_size=spec.world_size,
            batch_size=spec.batch_size,
            seed=self.seed,
            start=spec.start,
            orders=lambda epoch: self.order_for(epoch, spec.num_samples, step, 0),
        )

    def order_for(self, epoch: int, num_samples: int, step: int, start: int) -> Order | None:
        """Epoch ``epoch``'s order.  A source that plans its own (``evenly.Mix``:
        ``epoch_order``) gets the global step and the pass's start; any other source is
        ordered by the shuffle mode."""
        epoch_order = getattr(self._source, "epoch_order", None)
        if epoch_order is not None:
            order: Order | None = epoch_order(
                self.seed, epoch, shuffle=self.shuffle_mode != "none", step=step, start=start
            )
            return order
        return make_order(
            self.shuffle_mode,
            num_samples,
            seed=self.seed,
            epoch=epoch,
            shard_sizes=getattr(self._source, "shard_sizes", None),
            block_shards=self.block_shards,
        )

    def __len__(self) -> int:
        """Samples this rank yields in the dataset's own pass (in progress or next)."""
        if get_worker_info() is None:
            self._note_main_view()
        wrapped, processes = len_asked(self)
        return processes * self.plan_for(self._own_spec(0, 1, False, wrapped)).samples_per_rank

    @property
    def num_skipped(self) -> int:
        """Samples replaced in the current pass because the source could not read them
        (``on_error="skip"``, all workers of this rank)."""
        return int(self._skipped.sum())

    def __iter__(self) -> Iterator[Any]:
        """Single samples of this worker's share of the next pass (a generator: errors
        are raised on the first ``next()``, where the DataLoader passes them on)."""
        info = get_worker_info()
        num_workers, worker_id = (info.num_workers, info.id) if info is not None else (1, 0)
        check_pass(self, info.dataset if info is not None else None, self._wrapped)
        spec = self._own_spec(worker_id, num_workers, count=True)
        skip, self._local_skip = self._local_skip, 0
        if info is None:
            self._skipped.zero_()
            warn_about(self.plan_for(spec), num_workers, spec.rank)
        yield from self.read(spec, worker_id, num_workers, skip=skip)

    # ---- reading a pass (both owners) --------------------------------------------
    def read(
        self,
        spec: PassSpec,
        worker_id: int,
        num_workers: int,
        *,
        skip: int = 0,
        collate: Callable[[list[Any]], Any] | None = None,
        columnar: bool = False,
        skipped: torch.Tensor | None = None,
    ) -> Iterator[Any]:
        """This worker's share of the pass ``spec``: single samples, or with ``collate``
        (or ``columnar``) one collated batch per plan batch.  A generator: every check
        runs on the first ``next()``."""
        self._check_current(spec, own=not spec.handoff)
        plan = self.stream_plan_for(spec) if spec.infinite else self.plan_for(spec)
        self._progress[0] = skip
        ctx = ReadContext(
            self._source,
            plan,
            spec.rank,
            num_workers,
            worker_id,
            self._transform,
            self.on_error,
            self._skipped if skipped is None else skipped,
            self._progress,
            self.seed_generators,
            columnar,
        )
        batches = read_batches(ctx, skip)
        if columnar:
            yield from batches
        elif collate is None:
            for batch in batches:
                yield from batch
        else:
            for batch in batches:
                yield collate(batch)

    def _check_current(self, spec: PassSpec, own: bool = False) -> None:
        """Raise if this process's copy of the source or transform is not the one the
        pass was planned over (a persistent worker that outlived a change): checked
        against the spec, and for the dataset's own passes against what the main process
        last saw (its ``set_epoch``, ``len()`` or pickling)."""
        check_current(
            spec,
            len(self._source),
            self._generation,
            self._seen.tolist() if own else None,
            self.source_fingerprint,
        )
