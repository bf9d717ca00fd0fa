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
themselves (:func:`find_path`).  Nothing looks at a caller: ``len(dataset)`` is the pass
as it would run now, so a count asked of a prepared loader before its pass (the HF Trainer
asks one) is the dataset's own share; :func:`before_pass` raises, before the first batch,
where that count was asked and differs from what the pass yields, naming the fix
(``evenly.interop.hf_trainer.TrainerMixin``, or an ``evenly.DataLoader`` handed to
``prepare()``).  The hooks are registered with the lower layers by
``evenly.interop`` (:class:`evenly.runtime.hooks.PassHooks`): the dataset never imports
this module.

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
  ``len(self.base_dataloader)``, whose answer torch records on the base loader
  (``evenly.runtime.torch_compat.len_answered``); ``IterableDatasetShard.__len__`` calls
  ``len(self.dataset)``;
- with ``use_stateful_dataloader=True`` the adapter's ``__init__`` calls the base
  ``StatefulDataLoader.state_dict()``, which starts its iterator (and its workers) inside
  ``prepare()`` and marks it ``_initial_iter_for_state_dict`` until the first ``iter()``.

Accelerate is never imported here: only looked up if the program already imported it.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any

from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from torch.utils.data import Dataset as TorchDataset

from evenly.runtime import torch_compat
from evenly.runtime.hooks import Wrapped

__all__ = [
    "before_pass",
    "check_pass",
    "driving",
    "find_path",
]

#: How deep wrappers may nest (objects between a loader and the evenly.Dataset).
MAX_DEPTH = 16
#: How many objects one search looks at, at most.
MAX_OBJECTS = 512

_FIX = "or hand an evenly.DataLoader to accelerator.prepare() (it is kept as it is)"
#: the adapter for the HF Trainer (``evenly.interop.hf_trainer``)
_TRAINER_FIX = (
    "With the HF Trainer, mix evenly.interop.hf_trainer.TrainerMixin into your Trainer "
    "(class MyTrainer(TrainerMixin, Trainer)) and make train_dataset the evenly.Dataset "
    "itself (per-sample work goes in its transform=): its get_train_dataloader() returns "
    "an evenly.DataLoader"
)


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
    _check_len(active, base)


def _check_len(active: Any, base: Any) -> None:
    """Raise if ``len()`` of the prepared loader was asked before this pass and its
    answer is not what the pass yields: evenly answered it without knowing that the
    wrapper would drive the pass (it looks at no caller), so steps counted from it (the
    HF Trainer counts an epoch's steps that way) would lose or repeat samples."""
    answered = torch_compat.len_answered(base)
    if answered is None:
        return
    try:
        now = len(base.dataset)  # the wrapper drives the dataset now: the pass's count
    except TypeError:
        return
    if now != answered:
        raise RuntimeError(
            f"evenly: len() of the loader Accelerate prepared over this evenly.Dataset was "
            f"asked before its pass and counted {answered} sample(s), but under "
            f"{_name(active)} the pass yields {now}: evenly answers len() without looking "
            f"at who asks, so before the pass it counts the dataset's own share, and steps "
            f"counted from it would lose or repeat samples. {_TRAINER_FIX}; with "
            f"Accelerate alone, ask len() of an evenly.DataLoader handed to "
            f"accelerator.prepare() (it is kept as it is)"
        )


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
            path = find_path(_base(active), dataset)
            _check_shards(path or [], loaders)
            if path is not None:
                _check_len(active, _base(active))
        return
    path = find_path(worker_dataset, dataset)
    if path is not None:
        if loaders is not None:
            _check_shards(path, loaders)
            if snapshot is None and _kind(active, loaders) is not None:  # forked
                base = _base(active)
                if getattr(base, "dataset", None) is worker_dataset:
                    _check_len(active, base)
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
