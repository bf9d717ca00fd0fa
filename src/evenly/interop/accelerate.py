"""How HF Accelerate (and so the HF Trainer) drives an ``evenly.Dataset`` that reached
``accelerator.prepare()`` inside a plain DataLoader.

``prepare()`` rebuilds such a loader from ``loader.dataset``.  For an iterable dataset it
either has rank 0 read for everyone and deal the batches (``DataLoaderDispatcher``, the
default) or splits each rank's stream again (``DataLoaderShard`` over an
``IterableDatasetShard``, with ``dispatch_batches=False``).  Either would shard evenly's
already-sharded data a second time, so evenly adapts the pass it reads:

- under the dispatcher, rank 0 plans the whole epoch alone (one rank; the wrapper's batch
  size) and the dispatcher deals the batches to the ranks;
- under the shard wrapper, :func:`before_pass` makes the ``IterableDatasetShard`` pass
  everything through (the one change evenly makes to an Accelerate object) and evenly's
  own rank split applies.

The wrapper is recognised through what it is, never by guessing: Accelerate's
process-global ``GradientState`` names the adapter being iterated (from
``DataLoaderStateMixin.begin()``, before it calls ``set_epoch`` and before its base loader
starts workers, until ``end()``), and the dataset is found under it through the objects
themselves (:func:`find_path`).  Only ``len()``, which the HF Trainer and the adapters ask
before any iteration, looks at its caller: :func:`len_asked` is that one inspection.

What this module relies on, pinned by ``tests/test_accelerate_internals.py`` against the
installed version (``constraints.txt``):

- ``accelerate.state.GradientState._shared_state`` is empty until Accelerate is
  initialised; ``GradientState().active_dataloader`` is the adapter whose ``__iter__`` is
  running (``DataLoaderDispatcher`` / ``DataLoaderShard``), ``None`` once its epoch ended;
- an adapter keeps its torch loader in ``vars(adapter)["base_dataloader"]``, whose
  ``dataset`` is the prepared loader's dataset, or an ``IterableDatasetShard`` over it
  (``dataset``, ``batch_size``, ``drop_last``, ``num_processes``, ``process_index``,
  ``split_batches``: with ``num_processes=1, batch_size=1`` it yields its dataset as is);
- both adapters call ``dataset.set_epoch`` in ``__iter__`` after ``begin()`` and before
  ``base_dataloader.__iter__()`` (``IterableDatasetShard.set_epoch`` passes it down);
- ``len(adapter)``: ``DataLoaderDispatcher.__len__`` / ``DataLoaderAdapter.__len__`` call
  ``len(self.base_dataloader)``, torch's ``DataLoader.__len__`` calls
  ``len(self.dataset)`` and ``IterableDatasetShard.__len__`` calls ``len(self.dataset)``:
  each a Python frame named ``__len__`` whose ``self`` is that object;
- with ``use_stateful_dataloader=True`` the adapter's ``__init__`` calls the base
  ``StatefulDataLoader.state_dict()``, which starts its iterator (and its workers) inside
  ``prepare()`` and marks it ``_initial_iter_for_state_dict`` until the first ``iter()``.

Accelerate is never imported here: only looked up if the program already imported it.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from types import FrameType, ModuleType
from typing import Any

from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from torch.utils.data import Dataset as TorchDataset

from evenly.core.topology import Topology

__all__ = [
    "Wrapped",
    "before_pass",
    "check_pass",
    "driving",
    "find_path",
    "len_asked",
    "under",
]

#: How deep wrappers may nest (objects between a loader and the evenly.Dataset).
MAX_DEPTH = 16
#: How many objects one search looks at, at most.
MAX_OBJECTS = 512

_FIX = "or hand an evenly.DataLoader to accelerator.prepare() (it is kept as it is)"


@dataclass(frozen=True)
class Wrapped:
    """How an Accelerate wrapper drives the dataset's pass.

    ``mode``: ``"dispatch"`` (rank 0 reads for all ranks), ``"shard"`` (each rank reads its
    own share, through a passed-through ``IterableDatasetShard``, or with one process
    through none), or ``"hidden"`` (a wrapper
    is being iterated, but the dataset cannot be found under it; ``through`` names the
    type of the wrapper's dataset).  ``batch_size``: the wrapper's per-rank batch size
    (whole batches go to one worker)."""

    mode: str
    batch_size: int = 1
    through: str = ""


def under(wrapped: Wrapped | None, own: Topology) -> tuple[Topology, int]:
    """The (topology, plan batch size) of a pass driven by ``wrapped``; ``own``: the
    dataset's data-parallel topology."""
    if wrapped is None or wrapped.mode == "hidden":
        return own, 1
    if wrapped.mode == "dispatch":
        return Topology(0, 1), wrapped.batch_size  # rank 0 reads; the wrapper deals
    return own, wrapped.batch_size


# ---- finding the dataset under a wrapper ---------------------------------------------
def _children(obj: Any) -> list[Any]:
    """The datasets and loaders ``obj`` holds in its instance attributes (any name), or
    in lists/tuples there; an Accelerate adapter's ``base_dataloader`` is one of them."""
    attrs = getattr(obj, "__dict__", None)
    if not isinstance(attrs, dict):
        return []
    out: list[Any] = []
    for value in attrs.values():
        items = value if isinstance(value, (list, tuple)) else (value,)
        out.extend(v for v in items if isinstance(v, (TorchDataset, DataLoader)))
    return out


def find_path(root: Any, target: Any) -> list[Any] | None:
    """The objects from ``root`` down to ``target``, each held by the previous one in an
    instance attribute (any name) as a torch Dataset or DataLoader (or in a list/tuple
    of them), at most ``MAX_DEPTH`` deep; ``None`` if ``target`` is not found that way.
    Nothing is called on the objects (no properties, no ``__getattr__``); an
    ``evenly.Dataset`` other than ``target`` is not searched."""
    return _search(root, target)[0]


def _search(root: Any, target: Any) -> tuple[list[Any] | None, list[Any]]:
    """(path to ``target`` or None, the iterable datasets found that are neither evenly
    datasets nor hold any dataset: streams another wrapper would split on its own)."""
    from evenly.dataset import Dataset

    seen: set[int] = set()
    others: list[Any] = []
    found: list[Any] | None = None
    stack: list[tuple[Any, list[Any]]] = [(root, [root])]
    while stack and len(seen) < MAX_OBJECTS:
        obj, path = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if obj is target:
            found = found or path
            continue
        if obj is not root and isinstance(obj, Dataset):
            continue
        children = _children(obj)
        if not children and isinstance(obj, IterableDataset):
            others.append(obj)
        if len(path) <= MAX_DEPTH:
            stack.extend((child, [*path, child]) for child in reversed(children))
    return found, others


# ---- Accelerate's process-global state -------------------------------------------------
def _loaders() -> ModuleType | None:
    return sys.modules.get("accelerate.data_loader")


def _active() -> Any:
    """The Accelerate adapter being iterated in this process (GradientState), if any;
    an uninitialised GradientState is left as it is."""
    state = sys.modules.get("accelerate.state")
    if state is None or not state.GradientState._shared_state:
        return None
    return state.GradientState().active_dataloader


def _kind(loader: Any, loaders: ModuleType) -> str | None:
    # isinstance against Accelerate's classes first: an adapter claims its base loader's
    # class (``DataLoaderAdapter.__class__``), so it also passes isinstance(x, DataLoader)
    if isinstance(loader, loaders.DataLoaderDispatcher):
        return "dispatch"
    if isinstance(loader, loaders.DataLoaderShard):
        return "shard"
    return None


def _base(adapter: Any) -> Any:
    attrs = getattr(adapter, "__dict__", None)
    return attrs.get("base_dataloader") if isinstance(attrs, dict) else None


def _batch(base: Any) -> int:
    size = vars(base).get("batch_size") if hasattr(base, "__dict__") else None
    return size if isinstance(size, int) and size > 0 else 1


def _shards(path: list[Any], loaders: ModuleType) -> list[Any]:
    return [obj for obj in path if isinstance(obj, loaders.IterableDatasetShard)]


def _name(obj: Any) -> str:
    return type(obj).__qualname__


def _drive(dataset: object) -> Wrapped | None:
    loaders, active = _loaders(), _active()
    if loaders is None or active is None:
        return None
    kind, base = _kind(active, loaders), _base(active)
    if kind is None or base is None:
        return None
    path = find_path(base, dataset)
    if path is None:
        return Wrapped("hidden", through=_name(getattr(base, "dataset", None)))
    # "shard": each rank reads its own share (through a passed-through
    # IterableDatasetShard, or none at all with one process), in the wrapper's batches
    return Wrapped(kind, _batch(base))


def driving(dataset: object, snapshot: Wrapped | None = None) -> Wrapped | None:
    """How the Accelerate wrapper being iterated drives ``dataset`` now (None: it does not).

    In the main process, and in a forked DataLoader worker (whose memory is the main
    process's when the workers started), from ``GradientState``'s active adapter and the
    objects under it.  A worker started with spawn/forkserver has no Accelerate state: it
    uses ``snapshot``, what this function said in the main process when the dataset was
    pickled for it.  No side effects."""
    if snapshot is not None and get_worker_info() is not None:
        return snapshot
    return _drive(dataset)


# ---- the pass start (set_epoch in the main process) -------------------------------------
def before_pass(dataset: object) -> None:
    """Called by ``Dataset.set_epoch`` in the main process (Accelerate's adapters call it
    from ``__iter__``, before their workers start).  If the adapter being iterated drives
    ``dataset`` through Accelerate's ``IterableDatasetShard``, make that shard pass
    everything through (``num_processes=1, process_index=0, batch_size=1,
    drop_last=False``): evenly already gives each rank exactly its share.  This is the
    only change evenly makes to an Accelerate object.

    Raises (before the first batch) where the pass cannot be made right: the base
    loader's workers were started before the wrapper drove the dataset
    (``use_stateful_dataloader=True``), or the shard wraps other iterable datasets that
    passing it through would repeat on every rank."""
    loaders, active = _loaders(), _active()
    if loaders is None or active is None or _kind(active, loaders) is None:
        return
    base = _base(active)
    path, others = _search(base, dataset)
    if path is None:
        return
    if getattr(base, "_initial_iter_for_state_dict", False) and getattr(base, "num_workers", 0):
        raise RuntimeError(
            f"evenly: Accelerate's use_stateful_dataloader=True started the DataLoader "
            f"workers inside prepare() (StatefulDataLoader.state_dict()), before "
            f"{type(active).__name__} could tell this evenly.Dataset how it is read: those "
            f"workers read the wrong share and samples would be lost. Use "
            f"use_stateful_dataloader=False or num_workers=0, {_FIX}; an evenly.DataLoader "
            f"checkpoints exactly by itself"
        )
    shards = _shards(path, loaders)
    if shards and others:
        names = ", ".join(sorted({_name(o) for o in others}))
        raise RuntimeError(
            f"evenly: Accelerate's IterableDatasetShard splits {_name(path[1])} by rank, "
            f"and it reads this evenly.Dataset together with other iterable datasets "
            f"({names}): passing the shard through would repeat those on every rank, "
            f"keeping it would split evenly's share again. Make them evenly.Datasets too, "
            f"{_FIX}"
        )
    for shard in shards:
        shard.num_processes, shard.process_index, shard.batch_size = 1, 0, 1
        shard.drop_last = False


# ---- len(), asked before any iteration -----------------------------------------------
def len_asked(dataset: object) -> tuple[Wrapped | None, int]:
    """How to answer ``len(dataset)``, called directly from ``Dataset.__len__``: the pass
    to count (``None``: as :func:`driving` says now) and a factor.

    The HF Trainer and Accelerate's adapters ask ``len()`` right after ``prepare()``,
    before any iteration, so ``GradientState`` cannot tell yet.  The one inspection of
    the caller: the chain of ``__len__`` frames above ``Dataset.__len__``, each a wrapper
    holding the previous object (:func:`find_path`), up to a torch ``DataLoader.__len__``
    whose ``dataset`` is the top of the chain, called from the ``__len__`` of the
    Accelerate adapter that owns that loader.  Then the count is decided: the whole epoch
    (dispatcher); this rank's share times the shard's ``num_processes`` while the
    ``IterableDatasetShard`` still splits (so that its own arithmetic gives this rank's
    batches), this rank's share once it passes through.  Any other caller gets the
    dataset's pass as it would run now.  Raises where the count cannot be exact.  No side
    effects."""
    loaders = _loaders()
    frame = sys._getframe(1)
    if loaders is None or frame.f_locals.get("self") is not dataset:
        return None, 1
    obj: object = dataset
    chain: list[Any] = []
    caller = frame.f_back
    for _ in range(MAX_DEPTH + 2):
        owner = _len_owner(caller)
        if owner is obj:  # a subclass's __len__ calling the evenly.Dataset's
            caller = _up(caller)
            continue
        if owner is None:
            break
        if _is_torch_loader(owner) and vars(owner).get("dataset") is obj:
            return _asked_by(_len_owner(_up(caller)), owner, chain, loaders)
        path = find_path(owner, obj)
        if path is None:
            break
        chain.extend(path[:-1])
        obj, caller = owner, _up(caller)
    return None, 1


def _up(frame: FrameType | None) -> FrameType | None:
    return frame.f_back if frame is not None else None


def _len_owner(frame: FrameType | None) -> Any:
    if frame is None or frame.f_code.co_name != "__len__":
        return None
    return frame.f_locals.get("self")


def _is_torch_loader(obj: Any) -> bool:
    attrs = getattr(obj, "__dict__", None)
    adapter = not isinstance(attrs, dict) or "base_dataloader" in attrs
    return isinstance(obj, DataLoader) and not adapter


def _asked_by(
    adapter: Any, base: Any, chain: list[Any], loaders: ModuleType
) -> tuple[Wrapped | None, int]:
    if adapter is None or _base(adapter) is not base:
        return None, 1
    kind = _kind(adapter, loaders)
    if kind == "dispatch":
        return Wrapped("dispatch", _batch(base)), 1
    shards = _shards(chain, loaders)
    if kind != "shard":
        return None, 1
    if not shards or shards[0].num_processes == 1:
        return Wrapped("shard", _batch(base)), 1
    shard = shards[0]
    if shard.split_batches:
        raise RuntimeError(
            "evenly: len() of a prepared loader with split_batches=True and "
            "dispatch_batches=False, asked before its first pass: Accelerate's "
            "IterableDatasetShard would count this evenly.Dataset's batches wrongly. Use "
            f"split_batches=False or the default dispatch_batches, {_FIX}"
        )
    return Wrapped("shard", _batch(base)), int(shard.num_processes)


# ---- the pass itself (a worker, or the main process with num_workers=0) --------------
def check_pass(dataset: object, worker_dataset: object, snapshot: Wrapped | None) -> None:
    """Raise, naming the fix, if the pass about to be read would lose samples: an
    Accelerate ``IterableDatasetShard`` above ``dataset`` still splits by rank (the
    wrapper's ``set_epoch`` did not reach the evenly.Dataset), or an Accelerate wrapper
    reads the loader's dataset and the evenly.Dataset cannot be found under it.

    ``worker_dataset``: the worker's ``get_worker_info().dataset`` (None in the main
    process: then the adapter being iterated is looked at); ``snapshot``: what
    :func:`driving` said when the dataset was pickled (spawn/forkserver workers)."""
    loaders = _loaders()
    active = _active() if loaders is not None else None
    if worker_dataset is None:  # the main process reads the pass itself
        if loaders is not None and _kind(active, loaders) is not None:
            _check_shards(find_path(_base(active), dataset) or [], loaders)
        return
    path = find_path(worker_dataset, dataset)
    if path is not None:
        if loaders is not None:
            _check_shards(path, loaders)
        return
    if snapshot is not None:  # a spawned worker: what the main process saw
        hidden = snapshot.mode == "hidden" and snapshot.through == _name(worker_dataset)
    else:  # a forked worker: the main process's state when the workers started
        hidden = (
            loaders is not None
            and _kind(active, loaders) is not None
            and getattr(_base(active), "dataset", None) is worker_dataset
        )
    if hidden or (loaders is not None and isinstance(worker_dataset, loaders.IterableDatasetShard)):
        raise RuntimeError(
            f"evenly: Accelerate reads {_name(worker_dataset)}, which reads this "
            f"evenly.Dataset, but evenly cannot find it through that object's attributes, "
            f"so it cannot tell how the wrapper splits the data: samples would be lost. "
            f"Keep the evenly.Dataset in an attribute of your wrapper (any name; a torch "
            f"Dataset, or a list/tuple of them, at any depth), {_FIX}"
        )


def _check_shards(path: list[Any], loaders: ModuleType) -> None:
    for shard in _shards(path, loaders):
        if isinstance(shard.num_processes, int) and shard.num_processes > 1:
            raise RuntimeError(
                f"evenly: Accelerate's IterableDatasetShard(num_processes="
                f"{shard.num_processes}) wraps this evenly.Dataset and would split each "
                f"rank's share again: samples would be lost. Its set_epoch() did not reach "
                f"the evenly.Dataset before the pass started: give every wrapper of your "
                f"own a set_epoch(epoch) that calls the evenly.Dataset's, {_FIX}"
            )
