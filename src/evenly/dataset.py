"""``evenly.Dataset``: each sample exactly once per epoch across DDP ranks and workers.

The user's view: settings, topology, ``set_epoch``, ``len``, and its own passes under any
loader but ``evenly.DataLoader`` (which uses the :class:`~evenly.runtime.planner.Planner`):
:mod:`evenly.runtime.own_passes`; ``set_epoch`` marks a pass start, later passes follow.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

import torch
from torch.utils.data import IterableDataset, get_worker_info

from evenly.core.packing.settings import Packing
from evenly.core.plan import EpochPlan
from evenly.core.source import Source
from evenly.core.spec import PassSpec
from evenly.core.state import PassState
from evenly.core.topology import Topology
from evenly.errors import StateError, check_int
from evenly.options import Generator, OnError, Pad, Shuffle
from evenly.runtime import hooks
from evenly.runtime.checks import warn_about
from evenly.runtime.delegation import Delegation, PassOwner, read_delegated
from evenly.runtime.detect import (
    group_of,
    is_detected_from_environment,
    resolve_topology,
    warn_if_rank_local,
)
from evenly.runtime.hooks import Wrapped, under
from evenly.runtime.own_passes import OwnPasses
from evenly.runtime.planner import Planner
from evenly.runtime.seeds import GENERATORS

__all__ = ["Dataset", "planner_of"]

T_co = TypeVar("T_co", covariant=True)

#: Per-worker counters of samples replaced under on_error="skip".
SKIP_SLOTS = 64
_UNSET = -1


class Dataset(IterableDataset[Any], Generic[T_co]):
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
        rank: overrides the detected rank.
        world_size: overrides the detected world size.
        process_group: the data-parallel group (a torch ProcessGroup or a DeviceMesh
            dimension): rank and world size are taken within it, the plan agreement runs
            in it, and ranks outside it with the same group rank (tensor/pipeline peers of
            one replica) get identical batches.
        block_shards: shards per shuffle window in ``"block"`` mode.
        on_error: ``"raise"`` (default): a sample the source cannot read raises, naming
            it; ``"skip"``: it is replaced by another sample (so every rank keeps its
            batch count), logged, counted in ``num_skipped`` and reported at epoch end.
        pad: the epoch's short last step, when it does not split evenly over the ranks
            (no effect with ``drop_last=True``).  ``"repeat"`` (default): a few samples
            are repeated (fewer than ``world_size``, reported) so every rank yields the
            same batches.  ``"none"`` (exact evaluation): nothing repeated, nothing
            dropped; ranks yield at most one batch apart (``len()`` stays true per rank),
            so a collective at every step (DDP's all-reduce, FSDP's all-gather,
            ``gather_for_metrics``) would hang there: use ``"mask"`` for those.
            ``"mask"``: as ``"repeat"``, and the transform (required) is told which
            samples are the repeats (:func:`evenly.is_padding`) to mark them, e.g. a
            label of -100 or a weight of 0.
        pack: an :class:`evenly.Packing`: documents packed into rows (``docs/packing.md``).
    """

    def __init__(
        self,
        source: Source[T_co],
        *,
        shuffle: Shuffle = False,
        seed: int = 0,
        drop_last: bool = False,
        transform: Callable[[Any], Any] | None = None,
        seed_generators: tuple[Generator, ...] | list[Generator] = GENERATORS,
        rank: int | None = None,
        world_size: int | None = None,
        process_group: Any = None,
        block_shards: int = 8,
        on_error: OnError = "raise",
        pad: Pad = "repeat",
        pack: Packing | None = None,
    ) -> None:
        self._planner = Planner(  # plans, reads and checkpoints passes: what loaders use
            source,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
            transform=transform,
            seed_generators=seed_generators,
            block_shards=block_shards,
            on_error=on_error,
            pad=pad,
            pack=pack,
        )
        self._rank = None if rank is None else check_int("rank", rank, minimum=0)
        self._world_size = (
            None if world_size is None else check_int("world_size", world_size, minimum=1)
        )
        self.process_group = group_of(process_group)
        if self._rank is not None and self._world_size is not None:
            Topology(self._rank, self._world_size)
        self._fixed: Topology | None = None  # fixed in the main process once detected
        self._warned_rank_local = False
        self._owned = False  # owned by an evenly.DataLoader (``_owner``: the last one)
        self._owner: weakref.ref[PassOwner] | None = None
        self._passes = OwnPasses()
        # what the main process saw last (len, fingerprint, generation), for workers
        self._seen = torch.tensor([_UNSET, 0, 0], dtype=torch.int64).share_memory_()  # type: ignore[no-untyped-call]
        self._skipped = torch.zeros(SKIP_SLOTS, dtype=torch.int64).share_memory_()  # type: ignore[no-untyped-call]
        self._progress = [0]  # samples handed out in this process's pass
        self._wrapped: Wrapped | None = None  # a spawned copy: how a framework drove it
        self.topology()
        self._note_main_view()

    @property
    def source(self) -> Source[T_co]:
        """The samples.  Replacing it starts a new generation: persistent workers holding
        the old one raise instead of reading it (evenly.DataLoader restarts them)."""
        source: Source[T_co] = self._planner.source
        return source

    @source.setter
    def source(self, value: Source[T_co]) -> None:
        self._planner.replace(value, which="source")
        self._note_main_view()

    @property
    def transform(self) -> Callable[[Any], Any] | None:
        """The per-sample transform (replacing it starts a new generation, as ``source``)."""
        return self._planner.transform

    @transform.setter
    def transform(self, value: Callable[[Any], Any] | None) -> None:
        self._planner.replace(transform=value, which="transform")
        self._note_main_view()

    @property
    def shuffle_mode(self) -> str:
        """``"none"``, ``"global"`` or ``"block"`` (``shuffle=True`` resolved)."""
        return self._planner.shuffle_mode

    @property
    def seed(self) -> int:
        return self._planner.seed

    @property
    def drop_last(self) -> bool:
        return self._planner.drop_last

    @property
    def block_shards(self) -> int:
        return self._planner.block_shards

    @property
    def on_error(self) -> str:
        return self._planner.on_error

    @property
    def pad(self) -> str:
        """How the epoch's short last step is shared: "repeat", "none" or "mask"."""
        return self._planner.pad

    @property
    def seed_generators(self) -> tuple[str, ...]:
        return self._planner.seed_generators

    def _note_main_view(self) -> None:
        """Record, for workers, the source length, fingerprint and generation seen now."""
        if get_worker_info() is None:
            self._seen[:] = torch.tensor(self._planner.main_view(), dtype=torch.int64)

    def topology(self) -> Topology:
        """This process's data-parallel (rank, world_size): explicit, else the given
        process group, else torch.distributed, else torchrun's variables, else 0 of 1.

        In the main process it is resolved and fixed as soon as it can be detected; a
        DataLoader worker uses the value fixed in the main process (spawn/forkserver
        workers have no process group of their own).
        """
        if not self._warned_rank_local and get_worker_info() is None:
            self._warned_rank_local = warn_if_rank_local(
                self._world_size, self.process_group, "evenly.Dataset"
            )
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
        if get_worker_info() is None and self._owned:  # spawned workers see no framework
            state["_delegation"] = self._delegation()
        state["_owner"] = None
        state["process_group"] = None
        state["_wrapped"] = self._driven()
        return state

    def _driven(self) -> Wrapped | None:
        """How a framework's loader drives this dataset's pass now (registered hooks,
        :mod:`evenly.runtime.hooks`); a spawned worker has no framework state: it uses
        what the main process saw when it pickled the dataset."""
        if self._wrapped is not None and get_worker_info() is not None:
            return self._wrapped
        return hooks.driving(self)

    def _delegation(self) -> Delegation | None:
        """The owning evenly.DataLoader's pass, if a framework's skip-loader reads this
        dataset in this process now (:mod:`evenly.runtime.delegation`)."""
        k = hooks.skipping(self) if self._owned else None
        owner = None if k is None or self._owner is None else self._owner()
        return None if k is None or owner is None else owner._delegated_pass(k)

    # ---- the package's interface for evenly.DataLoader (not public API) ------------
    def _adopt(self, owner: PassOwner) -> None:
        """``owner`` (an evenly.DataLoader) runs this dataset's passes from now on: a
        framework's skip-loader over the dataset reads the last owner's pass."""
        self._owned, self._owner = True, weakref.ref(owner)

    def _epoch_calls(self) -> tuple[int, int]:
        """(how many times ``set_epoch`` was called in this process, the last epoch):
        an owner follows a call made after its own."""
        return self._passes.epoch_calls

    # ---- the dataset's own passes (under a loader that is not evenly's) ------------
    @property
    def epoch(self) -> int:
        """The epoch of the dataset's own pass in progress (or of the next one)."""
        return self._passes.current().epoch

    def set_epoch(self, epoch: int) -> None:
        """Make the next pass epoch ``epoch``, from its start; later passes follow it.

        Under any loader the epoch advances by itself with every pass; call this to
        replay an epoch or to follow a framework's epoch counter (as with
        ``DistributedSampler``).  An ``evenly.DataLoader`` over this dataset follows the
        call too, unless its own ``set_epoch``/``load_state_dict`` came later.
        """
        epoch = check_int("epoch", epoch, minimum=0)
        if get_worker_info() is None:
            hooks.before_pass(self)
        self._passes.set_epoch(epoch)
        self._skipped.zero_()
        self._note_main_view()
        self.topology()

    def _own_spec(self, state: PassState) -> PassSpec:
        topo, batch = under(self._driven(), self.topology())
        n = self._planner.num_samples()
        return PassSpec(
            epoch=state.epoch,
            start=min(state.position, self._planner.units(state.epoch)),
            num_samples=n,
            batch_size=batch,
            drop_last=self.drop_last,
            rank=topo.rank,
            world_size=topo.world_size,
            generation=self._planner.generation,
            source=state.source,
        )

    def plan(self) -> EpochPlan:
        """The plan of the dataset's own pass in progress, or of the next one."""
        return self._planner.plan_for(self._own_spec(self._passes.current()))

    def __len__(self) -> int:
        """Samples this rank yields in the dataset's own pass (in progress or next), as
        it would run now: under a framework's loader that drives it (Accelerate's
        dispatcher reads the whole epoch on rank 0), while that loader iterates it.  The
        answer never depends on who asks.

        It changes no pass, topology or wrapper state; it only publishes the source's
        length and identity as the main process sees them, so that workers holding an
        older copy raise instead of reading it."""
        if get_worker_info() is None:
            self._note_main_view()
        spec = self._own_spec(self._passes.current())
        return self._planner.plan_for(spec).rank_samples(spec.rank)

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
        hooks.check_pass(self, info.dataset if info is not None else None, self._wrapped)
        delegation = self.__dict__.get("_delegation") or self._delegation()
        if delegation is not None:  # accelerate's skip_first_batches: the owner's pass
            yield from read_delegated(
                self._planner, delegation, worker_id, num_workers, seen=self._seen.tolist()
            )
            return
        key = self._passes.key(info)
        state, skip = self._passes.begin(key, num_workers)
        spec = self._own_spec(state)
        if info is None:
            self._skipped.zero_()
            warn_about(self._planner.plan_for(spec), num_workers, spec.rank, batches=spec.handoff)
        yield from self._planner.read(
            spec,
            worker_id,
            num_workers,
            skip=skip,
            skipped=self._skipped,
            progress=self._progress,
            seen=self._seen.tolist(),
        )
        self._passes.finish(key)

    def state_dict(self, samples_received: int | None = None) -> dict[str, Any]:
        """The position in the dataset's own pass as a small JSON-serialisable dict.

        With ``evenly.DataLoader`` use ``loader.state_dict()``.  Here, the position is
        ``samples_received``: the samples this rank's loop received in the pass.  It may
        be left out where this process counted them itself (``num_workers=0``); under a
        loader with workers it must be given (``StateError`` otherwise).  Inside a
        DataLoader worker (as torchdata's ``StatefulDataLoader`` calls it) the state also
        records that worker's progress.
        """
        info = get_worker_info()
        if info is not None:
            running = self._passes.running or self._passes.current()
            # the pass's start (a planned source, a Mix, adds its part), never past it
            state = self._planner.to_state(running)
            topo = self.topology()
            state["worker"] = {
                "id": info.id,
                "num_workers": info.num_workers,
                "yielded": self._progress[0],
                "world_size": topo.world_size,
            }
            return state
        if samples_received is None and self._passes.last_ran_in_a_worker():
            raise StateError(
                "evenly: dataset.state_dict() cannot know how many samples the training "
                "loop received: the pass runs in DataLoader workers, which read ahead. "
                "Pass state_dict(samples_received=<samples this rank's loop received in "
                "the epoch>), or use evenly.DataLoader (loader.state_dict() counts them)"
            )
        current = self._passes.last()
        spec = self._own_spec(current)
        plan = self._planner.plan_for(spec)
        received = self._progress[0] if samples_received is None else samples_received
        received = check_int("samples_received", received, minimum=0)
        position = plan.consumed_after(received // plan.batch_size)
        if received >= plan.rank_samples(spec.rank) or position >= plan.end:
            return self._planner.to_state(PassState(plan.epoch + 1, source=current.source))
        at = PassState(plan.epoch, position, source=current.source)
        return self._planner.to_state(at, order=plan.order)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume the dataset's own passes from ``state``: the next pass continues with
        the first sample not yet consumed, under any number of ranks, workers or batch
        size (``evenly.DataLoader`` users: ``loader.load_state_dict``).

        Raises ``evenly.StateError`` naming every field that does not match.
        """
        loaded = self._planner.from_state(state)
        worker = state.get("worker")
        info = get_worker_info()
        if isinstance(worker, dict) and info is not None:
            if (worker.get("id"), worker.get("num_workers")) != (info.id, info.num_workers):
                raise StateError(
                    f"worker state of worker {worker.get('id')} of {worker.get('num_workers')} "
                    f"loaded into worker {info.id} of {info.num_workers}"
                )
            world = self.topology().world_size
            saved = worker.get("world_size", world)
            if saved != world:  # every rank's workers read alike: only the layout matters
                raise StateError(
                    f"a DataLoader worker's state saved under world_size={saved} cannot resume "
                    f"under world_size={world}: it counts what that worker read of its share "
                    f"of the old layout. Resume with the same world size, or use "
                    f"evenly.DataLoader (its state resumes under any topology)"
                )
            skip = check_int("state['worker']['yielded']", worker.get("yielded"), minimum=0)
            self._passes.restore_worker(loaded, skip)
            return
        self._passes.load(loaded, self._planner.carried(loaded))
        self._skipped.zero_()


def planner_of(dataset: Dataset[Any]) -> Planner:
    """How ``dataset`` plans, reads and checkpoints its passes: the one object its
    loaders, framework adapters and the audit talk to."""
    return dataset._planner
