"""``evenly.Dataset``: an IterableDataset over any sized, indexable source that reads each
sample exactly once per epoch across DDP ranks and DataLoader workers."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any, Generic, Protocol, TypeVar

import torch
from torch.utils.data import IterableDataset, get_worker_info

from ._plan import EpochPlan, check_int
from ._reader import ReadContext, read_share
from ._state import StateError, check_state, make_state
from ._topology import Topology, detect_topology

__all__ = ["Dataset", "EvenlyWarning", "Source"]

T_co = TypeVar("T_co", covariant=True)

# Slots of the shared state tensor, seen by the main process and every worker, so that
# persistent workers pick up a new epoch or a resume position.
_EPOCH, _START, _BATCH, _DROP, _RANK, _WORLD, _NUM = range(7)
_UNSET = -1
#: Per-worker counters of samples replaced under on_error="skip".
_SKIP_SLOTS = 64
SHUFFLE_MODES = ("none", "global", "block")


class Source(Protocol[T_co]):
    """What ``evenly.Dataset`` reads: anything with ``__len__`` and ``__getitem__``.

    A source may also define ``__getitems__(indices)`` (torch's batched-fetch hook) to
    read a whole batch at once.
    """

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> T_co: ...


class EvenlyWarning(UserWarning):
    """Something about the epoch the user should know: padding, idle workers, no data."""


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
    >>> sorted(first) != sorted(second) or first != second
    True

    Args:
        source: the samples: a list, numpy array, map-style torch Dataset, HF Dataset, or
            a sharded file source (``evenly.from_parquet`` ...).
        shuffle: ``False``; ``"global"`` (one permutation of all samples per epoch);
            ``"block"`` (sharded sources: shard order permuted per epoch, uniform shuffle
            inside windows of ``block_shards`` shards); ``True`` takes the source's
            preferred mode ("block" for remote shards, else "global").
        seed: the seed of the shuffle and of the per-sample random streams.
        drop_last: drop the epoch's remainder instead of padding it (see ``EpochPlan``).
        transform: called on each sample after ``random``, ``numpy.random`` and torch's
            default generator were seeded from (seed, epoch, the sample's global position).
        rank, world_size: override what is detected from ``torch.distributed`` or the
            ``RANK``/``WORLD_SIZE`` environment variables.
        block_shards: shards per shuffle window in ``"block"`` mode.
        on_error: ``"raise"`` (default): a sample the source cannot read raises, naming
            it; ``"skip"``: it is replaced by another sample (so every rank keeps its
            batch count), logged, counted in ``num_skipped`` and reported at epoch end.
    """

    def __init__(
        self,
        source: Source[T_co],
        *,
        shuffle: bool | str = False,
        seed: int = 0,
        drop_last: bool = False,
        transform: Callable[[Any], Any] | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        block_shards: int = 8,
        on_error: str = "raise",
    ) -> None:
        if not (hasattr(source, "__len__") and hasattr(source, "__getitem__")):
            raise TypeError(
                f"evenly.Dataset needs a source with __len__ and __getitem__, got "
                f"{type(source).__name__}; wrap a generator in a list, or write its "
                f"samples to shards with evenly.write()"
            )
        self.source = source
        self.shuffle_mode = _shuffle_mode(shuffle, source)
        self.shuffle = self.shuffle_mode != "none"
        self.block_shards = check_int("block_shards", block_shards, minimum=1)
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
        self.on_error = on_error
        self.seed = check_int("seed", seed)
        self.drop_last = bool(drop_last)
        self.transform = transform
        self._rank = None if rank is None else check_int("rank", rank, minimum=0)
        self._world_size = (
            None if world_size is None else check_int("world_size", world_size, minimum=1)
        )
        if self._rank is not None and self._world_size is not None:
            Topology(self._rank, self._world_size)
        self._shared = torch.tensor(
            [0, 0, 1, int(self.drop_last), _UNSET, _UNSET, _UNSET], dtype=torch.int64
        ).share_memory_()  # type: ignore[no-untyped-call]
        self._skipped = torch.zeros(_SKIP_SLOTS, dtype=torch.int64).share_memory_()  # type: ignore[no-untyped-call]
        #: (epoch, start) the next pass of an evenly.DataLoader must use, if set.
        self._pending: tuple[int, int] | None = None
        #: True once an evenly.DataLoader drives this dataset (it warns, not __iter__).
        self._loader_managed = False
        #: Samples this process's iterator has yielded in the current pass, and samples
        #: the next iterator must skip (a worker restored by a StatefulDataLoader).
        self._progress = [0]
        self._skip = 0

    # ---- configuration ---------------------------------------------------------
    def topology(self) -> Topology:
        """This process's (rank, world_size): explicit, else torch.distributed, else env."""
        return detect_topology(self._rank, self._world_size)

    @property
    def epoch(self) -> int:
        """The epoch of the pass in progress (or of the last one)."""
        return int(self._shared[_EPOCH])

    def set_epoch(self, epoch: int) -> None:
        """Make the next pass epoch ``epoch``, from its start.

        ``evenly.DataLoader`` advances epochs by itself; with a plain torch DataLoader,
        call this before each epoch, as with ``DistributedSampler``.
        """
        epoch = check_int("epoch", epoch, minimum=0)
        self._shared[_EPOCH] = epoch
        self._shared[_START] = 0
        self._shared[_NUM] = _UNSET
        self._pending = (epoch, 0)

    def _configure(self, *, batch_size: int, drop_last: bool) -> None:
        self._shared[_BATCH] = check_int("batch_size", batch_size, minimum=1)
        self._shared[_DROP] = int(drop_last)

    def _begin_pass(self, epoch: int, start: int) -> EpochPlan:
        """Fix this pass's plan in the shared state (main process, before workers read)."""
        topo = self.topology()
        self._shared[_EPOCH] = epoch
        self._shared[_START] = start
        self._shared[_RANK] = topo.rank
        self._shared[_WORLD] = topo.world_size
        self._shared[_NUM] = len(self.source)
        self._skipped.zero_()
        return self.plan()

    @property
    def num_skipped(self) -> int:
        """Samples replaced in the current pass because the source could not read them
        (``on_error="skip"``, all workers of this rank)."""
        return int(self._skipped.sum())

    def plan(self) -> EpochPlan:
        """The plan of the current pass, as every worker of this rank will follow it."""
        state = self._shared.tolist()
        world = state[_WORLD] if state[_WORLD] != _UNSET else self.topology().world_size
        n = state[_NUM] if state[_NUM] != _UNSET else len(self.source)
        start = min(state[_START], n)
        block = self.shuffle_mode == "block"
        return EpochPlan(
            num_samples=n,
            world_size=world,
            batch_size=state[_BATCH],
            drop_last=bool(state[_DROP]),
            shuffle=self.shuffle,
            seed=self.seed,
            epoch=state[_EPOCH],
            start=start,
            shard_sizes=tuple(self.source.shard_sizes) if block else None,  # type: ignore[attr-defined]
            block_shards=self.block_shards if block else 0,
        )

    def _current_rank(self) -> int:
        rank = int(self._shared[_RANK])
        return rank if rank != _UNSET else self.topology().rank

    def __len__(self) -> int:
        """Samples this rank yields in the current pass."""
        return self.plan().samples_per_rank

    # ---- iteration -------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        num_workers, worker_id = (info.num_workers, info.id) if info is not None else (1, 0)
        plan = self.plan()
        rank = self._current_rank()
        if info is None and not self._loader_managed:
            warn_about(plan, num_workers, rank)
        if info is not None and len(self.source) != plan.num_samples:
            raise RuntimeError(
                f"evenly: len(source) is {len(self.source)} in worker {worker_id} but was "
                f"{plan.num_samples} when epoch {plan.epoch} started: the source changed "
                f"length during the epoch"
            )
        skip, self._skip = self._skip, 0
        self._progress[0] = skip
        ctx = ReadContext(
            self.source,
            plan,
            rank,
            num_workers,
            worker_id,
            self.transform,
            self.on_error,
            self._skipped,
            self._progress,
        )
        return read_share(ctx, skip)

    @property
    def _yielded(self) -> int:
        """Samples this process's iterator has handed out in the current pass (counted a
        batch at a time, as the batch starts: exact at batch boundaries)."""
        return self._progress[0]

    # ---- checkpoints -----------------------------------------------------------
    def fingerprint(self) -> dict[str, Any]:
        """What a checkpoint state must agree on: N, seed, shuffle, drop_last, source."""
        fp: dict[str, Any] = {
            "num_samples": len(self.source),
            "seed": self.seed,
            "shuffle": self.shuffle_mode,
            "drop_last": bool(self._shared[_DROP]),
        }
        if self.shuffle_mode == "block":
            fp["block_shards"] = self.block_shards
        source = getattr(self.source, "fingerprint", None)
        if isinstance(source, str):
            fp["source"] = source
        return fp

    def state_dict(self, samples_received: int | None = None) -> dict[str, Any]:
        """The position in the current pass as a small JSON-serialisable dict.

        With ``evenly.DataLoader`` use ``loader.state_dict()``.  Here, the position is
        ``samples_received`` (samples this rank's loop received in the pass), by default
        the samples this process's iterator yielded, which is exact with
        ``num_workers=0``.  Inside a DataLoader worker (as torchdata's
        ``StatefulDataLoader`` calls it) the state also records that worker's progress.
        """
        plan = self.plan()
        info = get_worker_info()
        received = self._yielded if samples_received is None else samples_received
        received = check_int("samples_received", received, minimum=0)
        if info is not None:
            state = make_state(self.fingerprint(), plan.epoch, plan.start)
            state["worker"] = {
                "id": info.id,
                "num_workers": info.num_workers,
                "yielded": self._yielded,
            }
            return state
        position = plan.consumed_after(received // plan.batch_size)
        if received >= plan.samples_per_rank:
            position = plan.end
        return self._state_at(plan.epoch, position, plan.end)

    def _state_at(self, epoch: int, position: int, end: int) -> dict[str, Any]:
        if position >= end:  # the pass is over: the state points at the next epoch
            epoch, position = epoch + 1, 0
        return make_state(self.fingerprint(), epoch, position)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state``: the next pass continues with the first sample not yet
        consumed, under any number of ranks, workers or batch size.

        Raises ``evenly.StateError`` naming every field that does not match.
        """
        epoch, position = check_state(state, self.fingerprint())
        worker = state.get("worker")
        info = get_worker_info()
        if isinstance(worker, dict) and info is not None:
            if (worker.get("id"), worker.get("num_workers")) != (info.id, info.num_workers):
                raise StateError(
                    f"worker state of worker {worker.get('id')} of {worker.get('num_workers')} "
                    f"loaded into worker {info.id} of {info.num_workers}"
                )
            self._skip = check_int("state['worker']['yielded']", worker.get("yielded"), minimum=0)
        self._shared[_EPOCH] = epoch
        self._shared[_START] = position
        self._pending = (epoch, position)


def _shuffle_mode(shuffle: bool | str, source: object) -> str:
    """'none', 'global' or 'block'; ``True`` takes the source's preferred mode."""
    if shuffle is True:
        mode = getattr(source, "preferred_shuffle", "global")
    elif shuffle is False:
        mode = "none"
    else:
        mode = shuffle
    if mode not in SHUFFLE_MODES:
        raise ValueError(f"shuffle must be True, False, 'global' or 'block', got {shuffle!r}")
    if mode == "block" and not hasattr(source, "shard_sizes"):
        raise ValueError(
            f"shuffle='block' needs a sharded source with shard_sizes (evenly.from_parquet, "
            f"from_webdataset, from_jsonl); {type(source).__name__} has none: use "
            f"shuffle='global'"
        )
    return str(mode)


def warn_about(plan: EpochPlan, num_workers: int, rank: int) -> None:
    """Warn, in the main process, about padding, idle workers and empty sources."""
    if plan.num_samples == 0:
        warnings.warn(
            "evenly: the source is empty, so every rank yields 0 batches this epoch",
            EvenlyWarning,
            stacklevel=3,
        )
        return
    if plan.num_padded:
        warnings.warn(f"evenly: {plan.describe()}", EvenlyWarning, stacklevel=3)
    idle = plan.idle_workers(num_workers)
    if idle:
        warnings.warn(
            f"evenly: rank {rank} has {plan.num_batches} batch(es) this epoch for "
            f"{max(num_workers, 1)} workers: {idle} worker(s) idle",
            EvenlyWarning,
            stacklevel=3,
        )
