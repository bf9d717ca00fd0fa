"""Build a factory's loader traced, and record every sample it delivers as columns.

In each rank (``_resume`` drives the passes) the factory's dataset runs through a real
DataLoader with ``num_workers`` worker processes: an ``evenly.Dataset`` through
``evenly.DataLoader`` (which advances epochs by itself); anything else through
``torch.utils.data.DataLoader`` (torchdata's ``StatefulDataLoader`` for a resume audit),
with ``set_epoch(epoch)`` called before each epoch on the dataset, the sampler and the
batch sampler when they have one (``Built.set_epoch``), as a careful user would.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TextIO

import numpy as np
from torch.utils.data import DataLoader, IterableDataset

from evenly.dataset import Dataset as EvenlyDataset
from evenly.loader.loader import DataLoader as EvenlyLoader

from ._factory import Factory, describe, resolve
from ._trace import (
    MetaBatch,
    SplitCollate,
    TagCollate,
    TracedIterable,
    TracedMap,
    TracedStateful,
    default_id,
    draws_of,
    trace_evenly,
)
from ._types import (
    F64,
    I64,
    AuditError,
    IdFn,
    LoaderFactory,
    MixInfo,
    PackInfo,
    RankEpoch,
    Settings,
)

__all__ = [
    "AuditError",
    "Built",
    "Columns",
    "Job",
    "RankResult",
    "Settings",
    "build_loader",
    "describe",
    "resolve",
]

#: DataLoader arguments the audit sets itself; a factory may not override them.
_RESERVED = frozenset({"dataset", "batch_size", "num_workers"})


@dataclass(frozen=True)
class Job:
    """One factory to audit, with the function that names its samples."""

    factory: Factory
    id_fn: IdFn | None = None
    #: run the dataset under torchdata's StatefulDataLoader (a resume audit)
    stateful: bool = False


@dataclass
class RankResult:
    """Everything one rank delivered for one job, in delivery order (one row a sample)."""

    rank: int
    ids: I64 | list[Any] = field(default_factory=list)
    worker: I64 = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    epoch: I64 = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    batch: I64 = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    pos: I64 = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    draws: F64 = field(default_factory=lambda: np.zeros((0, 3), dtype=np.float64))
    reads: I64 = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    per_rank: list[RankEpoch] = field(default_factory=list)
    mix: MixInfo | None = None
    #: packed rows: ``(n, 4)`` pieces (row of this result, document, start, tokens)
    pieces: I64 | None = None
    pack: PackInfo | None = None
    #: ``(epoch, id)`` of each sample read but not in the collated batch the loop got
    dropped: list[tuple[int, Any]] = field(default_factory=list)
    expected: int | None = None
    expected_source: str = "unknown"
    warnings: list[str] = field(default_factory=list)
    #: what the rank saw of its place: torchrun's variables, its host name
    seen: dict[str, Any] = field(default_factory=dict)


def _length(obj: Any) -> int | None:
    try:
        return len(obj)
    except (TypeError, NotImplementedError, AttributeError):
        return None


def is_stateful(obj: Any) -> bool:
    """Whether ``obj`` saves and loads a state (``state_dict``/``load_state_dict``)."""
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


@dataclass
class Built:
    """A factory's dataset, traced, in its loader, and what a loop asks of it by kind: an
    ``evenly.Dataset`` (``evenly.DataLoader``, which knows its epoch), a ``LoaderFactory``
    (its own loader), an iterable or a map-style dataset (torch's or torchdata's loader)."""

    #: what the factory returned: a dataset or a ``LoaderFactory``
    dataset: Any
    loader: Any
    #: the factory's DataLoader arguments
    kwargs: dict[str, Any]
    iterable: bool

    @property
    def inner(self) -> Any:
        """The dataset itself (a ``LoaderFactory``'s ``dataset``)."""
        factory = isinstance(self.dataset, LoaderFactory)
        return self.dataset.dataset if factory else self.dataset

    @property
    def managed(self) -> bool:
        """``evenly.DataLoader`` over an ``evenly.Dataset``: it advances epochs itself."""
        return isinstance(self.dataset, EvenlyDataset)

    def set_epoch(self, epoch: int) -> None:
        """``set_epoch(epoch)`` where a careful loop calls it: the dataset, its sampler and
        batch sampler, and a loader the factory made itself."""
        objects = [self.inner, self.kwargs.get("sampler"), self.kwargs.get("batch_sampler")]
        if isinstance(self.dataset, LoaderFactory):
            objects.append(self.loader)
        for obj in objects:
            setter = getattr(obj, "set_epoch", None)
            if callable(setter):
                setter(epoch)

    def expected(self) -> tuple[int | None, str]:
        """Distinct samples an epoch should deliver across all ranks, and where that is
        from."""
        if isinstance(self.inner, EvenlyDataset):
            return _length(self.inner.source), "len(source)"
        n = _length(self.inner)
        if n is None:
            return None, "unknown"
        return n, "len(dataset)" if not self.iterable else "len(dataset) on rank 0"

    def reported(self) -> int | None:
        """The samples the loader says this rank's next pass holds: the pass
        ``evenly.DataLoader`` plans (its batch size and drop_last), ``len(dataset)``, or
        the sampler's length."""
        if self.managed:
            return self.loader.plan.samples_per_rank  # type: ignore[no-any-return]
        if self.iterable:
            return _length(self.inner)
        return _length(getattr(self.loader.batch_sampler, "sampler", None))

    def resumable(self) -> str | None:
        """None when the audit can save and load this loader's state; else why not: an
        ``evenly.Dataset`` (``evenly.DataLoader``), a ``LoaderFactory`` whose loader has a
        state, a dataset with ``state_dict``/``load_state_dict`` or a map-style dataset
        whose sampler has one (or none given: StatefulDataLoader's own sampler) resume."""
        dataset, loader = self.dataset, self.loader
        if self.managed:
            return None
        if isinstance(dataset, LoaderFactory):
            if is_stateful(loader):
                return None
            return f"its loader, a {type(loader).__name__}, has no state_dict/load_state_dict"
        sampler = self.kwargs.get("batch_sampler") or self.kwargs.get("sampler")
        if is_stateful(dataset) or is_stateful(sampler):
            return None
        if _is_iterable(dataset) or sampler is not None:
            what = type(sampler).__name__ if sampler is not None else "dataset"
            return (
                f"a {type(dataset).__name__} without state_dict/load_state_dict "
                f"({'its sampler, a ' + what + ', has none either' if sampler else 'iterable'})"
            )
        return None


def _split(made: Any, name: str) -> tuple[Any, dict[str, Any]]:
    """A factory returns a dataset, ``(dataset, dataloader_kwargs)`` or a ``LoaderFactory``."""
    if isinstance(made, tuple) and len(made) == 2 and isinstance(made[1], Mapping):
        dataset, kwargs = made[0], dict(made[1])
    else:
        dataset, kwargs = made, {}
    reserved = sorted(_RESERVED & kwargs.keys())
    if reserved:
        raise AuditError(
            f"factory {name} sets DataLoader argument(s) {reserved}: the audit sets those "
            f"itself (--workers, --batch-size); remove them from the factory's kwargs"
        )
    return dataset, kwargs


def _is_iterable(dataset: Any) -> bool:
    if isinstance(dataset, IterableDataset):
        return True
    return hasattr(dataset, "__iter__") and not hasattr(dataset, "__getitem__")


def _build(
    dataset: Any,
    kwargs: dict[str, Any],
    id_fn: IdFn,
    settings: Settings,
    name: str,
    stateful: bool = False,
) -> tuple[Any, bool]:
    """The traced dataset's loader, and whether the dataset is iterable (``stateful``:
    torchdata's ``StatefulDataLoader`` instead of torch's, for a resume audit)."""
    if isinstance(dataset, LoaderFactory):
        user_collate = kwargs.pop("collate_fn", None)
        tagged: Any = TagCollate(id_fn, user_collate)
        if isinstance(dataset.dataset, EvenlyDataset):  # its own loader over an evenly.Dataset
            trace_evenly(dataset.dataset, id_fn)
            tagged = SplitCollate(user_collate, id_fn)
        made = dataset.make(
            batch_size=settings.batch_size,
            num_workers=settings.num_workers,
            collate_fn=tagged,
            **kwargs,
        )
        return made, True
    collate = SplitCollate(kwargs.pop("collate_fn", None), id_fn)
    if isinstance(dataset, EvenlyDataset):
        loader: DataLoader[Any] = EvenlyLoader(
            trace_evenly(dataset, id_fn),
            batch_size=settings.batch_size,
            num_workers=settings.num_workers,
            collate_fn=collate,
            **kwargs,
        )
        return loader, True
    if _is_iterable(dataset):
        traced: Any = (TracedStateful if is_stateful(dataset) else TracedIterable)(dataset, id_fn)
        iterable = True
    elif hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__"):
        traced, iterable = TracedMap(dataset, id_fn), False
    else:
        raise AuditError(
            f"factory {name} returned a {type(dataset).__name__}, which is not a dataset "
            f"(no __iter__, no __getitem__ and __len__)"
        )
    if "batch_sampler" not in kwargs:
        kwargs["batch_size"] = settings.batch_size
    cls: Any = DataLoader
    if stateful:
        from torchdata.stateful_dataloader import StatefulDataLoader

        cls = StatefulDataLoader
    loader = cls(traced, num_workers=settings.num_workers, collate_fn=collate, **kwargs)
    return loader, iterable


class _WarningLog:
    """Keeps the first message of each distinct warning site, with a count."""

    def __init__(self) -> None:
        self.seen: dict[tuple[str, str, int], list[Any]] = {}

    def __call__(
        self,
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: TextIO | None = None,
        line: str | None = None,
    ) -> None:
        key = (category.__name__, filename, lineno)
        if key in self.seen:
            self.seen[key][1] += 1
        else:
            self.seen[key] = [f"{category.__name__}: {message}", 1]

    def lines(self) -> list[str]:
        return [text if n == 1 else f"{text} (x{n})" for text, n in self.seen.values()]


class Columns:
    """A rank's deliveries, one ``MetaBatch`` a batch, joined into columns at the end
    (nothing is kept or shipped per sample)."""

    def __init__(self) -> None:
        self.metas: list[MetaBatch] = []
        self.epochs: list[int] = []

    def add(self, epoch: int, metas: MetaBatch) -> None:
        self.metas.append(metas)
        self.epochs.append(epoch)

    def fill(self, result: RankResult, first_batch: dict[int, int] | None = None) -> None:
        """Set ``result``'s columns (``first_batch``: epoch -> the batch number the first
        recorded batch of that epoch had, for a run that resumed inside it)."""
        metas = self.metas
        unread = sorted({m.unread for m in metas if m.unread is not None})
        if unread:  # kept with the rank's warnings: the report shows them
            result.warnings.append(
                f"evenly audit: the samples of {sum(m.unread is not None for m in metas)} "
                f"batch(es) were recorded as read, not as the loop received them: the "
                f"collated batch could not be read back ({unread[0]}); pass id_fn= that "
                f"also names a collated sample"
            )
        result.dropped = [
            (e, i) for m, e in zip(metas, self.epochs, strict=True) for i in m.dropped or ()
        ]
        sizes = np.asarray([m.samples for m in metas], dtype=np.int64)
        epochs = np.asarray(self.epochs, dtype=np.int64)
        # batch number within its epoch: counts restart where the epoch changes
        index = np.arange(len(metas), dtype=np.int64)
        starts = np.flatnonzero(np.r_[True, epochs[1:] != epochs[:-1]]) if len(metas) else index
        batch_no = index - np.repeat(starts, np.diff(np.r_[starts, len(metas)]))
        if first_batch:
            batch_no += np.asarray([first_batch.get(int(e), 0) for e in epochs], dtype=np.int64)
        result.epoch = np.repeat(epochs, sizes)
        result.batch = np.repeat(batch_no, sizes)
        total = int(sizes.sum())
        result.pos = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(sizes) - sizes, sizes)
        if not metas:
            return
        table = np.concatenate([m.table for m in metas])  # one join of every batch's records
        result.worker = np.asarray(table["worker"], dtype=np.int64)
        result.draws = draws_of(table)
        result.reads = np.asarray(table["read"], dtype=np.int64)
        parts = [m.pieces for m in metas if m.pieces is not None]
        if len(parts) == len(metas):  # packed rows: pieces point at the rank's rows
            shift = np.repeat(np.cumsum(sizes) - sizes, [len(p) for p in parts])
            pieces = np.concatenate(parts)
            pieces[:, 0] += shift
            result.pieces = pieces
        if all(m.labels is None for m in metas):
            result.ids = np.asarray(table["id"], dtype=np.int64)
        else:
            result.ids = [
                i
                for m in metas
                for i in (m.labels if m.labels is not None else m.table["id"].tolist())
            ]


def build_loader(job: Job, settings: Settings) -> Built:
    """The factory's dataset, traced, in its loader."""
    name = describe(job.factory)
    factory = resolve(job.factory) if isinstance(job.factory, str) else job.factory
    dataset, kwargs = _split(factory(), name)
    loader, iterable = _build(
        dataset, kwargs, job.id_fn or default_id, settings, name, job.stateful
    )
    return Built(dataset, loader, kwargs, iterable)
