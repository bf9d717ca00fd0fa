"""Worker-side tracing: wrap the user's dataset so each sample leaves the worker as
``(sample, meta)``, and a collate function that splits ``meta`` off again before the
user's collate runs, so batches keep the structure the user's code expects.

``meta`` is ``(worker_id, sample_id, random_draw, numpy_draw, torch_draw, read)``.  The
three draws are made in the worker right after the sample is produced, from the
generators the user's augmentations would use, so two workers sharing a stream show the
same draws.  ``read`` is the global index an ``evenly.Mix`` was asked for to produce the
sample (its class is swapped for a recording subclass in the rank process, before the
workers start), ``-1`` for any other source: it tells which source a sample came from,
whatever the samples look like.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset as MapDataset
from torch.utils.data import IterableDataset, default_collate, get_worker_info

from evenly.dataset import Dataset as EvenlyDataset
from evenly.mixture import Mix

from ._types import IdFn

__all__ = [
    "ID_KEYS",
    "IdFn",
    "SplitCollate",
    "TracedEvenly",
    "TracedIterable",
    "TracedMap",
    "default_id",
    "record_mix_reads",
]

#: Keys looked up, in order, when a sample is a dict.
ID_KEYS = ("__key__", "idx", "id", "index")

Meta = tuple[int, Any, float, float, float, int]

#: ``read`` of a sample whose source index is not recorded.
UNKNOWN_READ = -1


def default_id(sample: Any) -> Any:
    """The id of a sample: itself if it is an int/str/bytes/float scalar, a one-element
    tensor's value, or a dict's ``__key__``/``idx``/``id``/``index`` entry.

    >>> default_id(7), default_id(torch.tensor(3)), default_id({"__key__": "a/001"})
    (7, 3, 'a/001')
    """
    if isinstance(sample, bool | int | np.integer):
        return int(sample)
    if isinstance(sample, str | bytes):
        return sample
    if isinstance(sample, float | np.floating):
        value = float(sample)
        return int(value) if value.is_integer() else value
    if isinstance(sample, torch.Tensor) and sample.numel() == 1:
        return default_id(sample.item())
    if isinstance(sample, np.ndarray) and sample.size == 1:
        return default_id(sample.item())
    if isinstance(sample, Mapping):
        for key in ID_KEYS:
            if key in sample:
                return default_id(sample[key])
    raise TypeError(
        f"evenly audit cannot tell which sample this is: a {type(sample).__name__} "
        f"({_short(sample)}); samples must be ints/strings, one-element tensors or dicts "
        f"with one of the keys {list(ID_KEYS)}, or pass id_fn= (--id-fn module:function)"
    )


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _worker_id() -> int:
    info = get_worker_info()
    return 0 if info is None else int(info.id)


def _meta(worker: int, sample: Any, id_fn: IdFn, read: int = UNKNOWN_READ) -> Meta:
    return (
        worker,
        id_fn(sample),
        random.random(),
        float(np.random.random()),
        float(torch.rand(()).item()),
        read,
    )


def _traced(
    items: Iterator[Any], id_fn: IdFn, reads: deque[int] | None = None
) -> Iterator[tuple[Any, Meta]]:
    """``(sample, meta)`` for each sample; with ``reads`` (a recording Mix's log of the
    indices it was asked for, in order), each sample takes the oldest index logged."""
    worker = _worker_id()
    for sample in items:
        yield sample, _meta(worker, sample, id_fn, _next_read(reads))


def _next_read(reads: deque[int] | None) -> int:
    return reads.popleft() if reads else UNKNOWN_READ


# ---- which index an evenly.Mix read ---------------------------------------------------
def _recording_getitem(self: Any, index: int) -> Any:
    sample = super(type(self), self).__getitem__(index)  # the Mix's own read
    self._audit_reads.append(int(index))  # logged once the read succeeded
    return sample


def _recording_getitems(self: Any, indices: Sequence[int]) -> list[Any]:
    samples: list[Any] = super(type(self), self).__getitems__(indices)
    self._audit_reads.extend(int(i) for i in indices)
    return samples


class RecordingMix(Mix):
    """An ``evenly.Mix`` that logs, in this process, each global index it reads
    (``__getitem__`` and ``__getitems__``, the only ways the reader gets a sample)."""

    _audit_reads: deque[int]
    _audit_recording = True
    __getitem__ = _recording_getitem
    __getitems__ = _recording_getitems


def record_mix_reads(mix: Mix) -> deque[int]:
    """Make ``mix`` log the indices it reads (a user subclass keeps its own methods: the
    recording class derives from it); return the log."""
    if type(mix) is Mix:
        mix.__class__ = RecordingMix
    elif not getattr(type(mix), "_audit_recording", False):
        attrs = {
            "_audit_recording": True,
            "__getitem__": _recording_getitem,
            "__getitems__": _recording_getitems,
        }
        mix.__class__ = type(f"Recording{type(mix).__name__}", (type(mix),), attrs)
    mix._audit_reads = deque()  # type: ignore[attr-defined]
    return mix._audit_reads  # type: ignore[attr-defined,no-any-return]


class TracedIterable(IterableDataset[tuple[Any, Meta]]):
    """An IterableDataset that yields ``(sample, meta)`` from the wrapped one's iterator.

    ``len()`` and ``set_epoch`` are forwarded, so the DataLoader and the audit see the
    wrapped dataset's own answers.
    """

    def __init__(self, inner: Any, id_fn: IdFn) -> None:
        self.inner = inner
        self.id_fn = id_fn

    def __iter__(self) -> Iterator[tuple[Any, Meta]]:
        return _traced(iter(self.inner), self.id_fn)

    def __len__(self) -> int:
        return len(self.inner)


class TracedMap(MapDataset[tuple[Any, Meta]]):
    """A map-style dataset whose ``__getitem__`` returns ``(dataset[i], meta)``."""

    def __init__(self, inner: Any, id_fn: IdFn) -> None:
        self.inner = inner
        self.id_fn = id_fn

    def __getitem__(self, index: int) -> tuple[Any, Meta]:
        sample = self.inner[index]
        return sample, _meta(_worker_id(), sample, self.id_fn)

    def __len__(self) -> int:
        return len(self.inner)


class TracedEvenly(EvenlyDataset[Any]):
    """An ``evenly.Dataset`` whose samples leave the worker as ``(sample, meta)``:
    installed on an existing instance by ``trace_evenly`` so ``evenly.DataLoader`` keeps
    driving it.  It traces ``read``, the one path by which every pass reaches the
    samples (the dataset's own passes and evenly.DataLoader's batch hand-off)."""

    _audit_id_fn: IdFn

    def read(  # type: ignore[override]
        self,
        spec: Any,
        worker_id: int,
        num_workers: int,
        *,
        collate: Callable[[list[Any]], Any] | None = None,
        **kwargs: Any,
    ) -> Iterator[Any]:
        id_fn = self._audit_id_fn
        kwargs["columnar"] = False  # the trace needs the samples themselves
        reads: deque[int] | None = getattr(self.source, "_audit_reads", None)
        if reads is not None:
            reads.clear()  # a pass left unfinished in this process must not shift the log
        if collate is None:
            yield from _traced(
                EvenlyDataset.read(self, spec, worker_id, num_workers, **kwargs), id_fn, reads
            )
            return
        worker = _worker_id()

        def traced_collate(batch: list[Any]) -> Any:
            return collate(
                [(sample, _meta(worker, sample, id_fn, _next_read(reads))) for sample in batch]
            )

        yield from EvenlyDataset.read(
            self, spec, worker_id, num_workers, collate=traced_collate, **kwargs
        )


def trace_evenly(dataset: EvenlyDataset[Any], id_fn: IdFn) -> EvenlyDataset[Any]:
    """Make ``dataset`` yield ``(sample, meta)`` while staying an ``evenly.Dataset``
    (over an ``evenly.Mix``, ``meta`` also names the index each sample was read from)."""
    if isinstance(dataset.source, Mix):
        record_mix_reads(dataset.source)
    if type(dataset) is not EvenlyDataset:
        # A user subclass: trace it through a subclass of its own class (fork workers).
        name = f"Traced{type(dataset).__name__}"
        cls = type(name, (type(dataset),), {"read": TracedEvenly.read})
        dataset.__class__ = cls
    else:
        dataset.__class__ = TracedEvenly
    dataset._audit_id_fn = id_fn  # type: ignore[attr-defined]
    return dataset


class SplitCollate:
    """Split ``(sample, meta)`` items into the user's collated batch and the metas."""

    def __init__(self, collate: Callable[[list[Any]], Any] | None) -> None:
        self.collate = default_collate if collate is None else collate

    def __call__(self, items: list[tuple[Any, Meta]]) -> tuple[Any, list[Meta]]:
        return self.collate([s for s, _ in items]), [m for _, m in items]
