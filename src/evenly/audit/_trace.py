"""Worker-side tracing: wrap the user's dataset so each sample leaves the worker as
``(sample, meta)``, and a collate function that splits ``meta`` off again before the
user's collate runs, so batches keep the structure the user's code expects.

``meta`` is ``(worker_id, sample_id, random_draw, numpy_draw, torch_draw, read)``.  The
three draws are made in the worker right after the sample is produced (for an
``evenly.Dataset``: after each batch the reader produces, one draw per sample in one call
per generator), from the generators the user's augmentations would use, so two workers
sharing a stream show the same draws.  ``SplitCollate`` ships a batch's metas as one
``MetaBatch`` of numpy columns, so records travel in bulk, not one object per sample.
``read`` is the global index an ``evenly.Mix`` was asked for to produce the
sample (the reader's tap sees the indices it reads), ``-1`` for any other source: it
tells which source a sample came from, whatever the samples look like.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt
import torch
from torch.utils.data import Dataset as MapDataset
from torch.utils.data import IterableDataset, default_collate, get_worker_info

from evenly.dataset import Dataset as EvenlyDataset
from evenly.dataset import planner_of
from evenly.mixture import Mix
from evenly.runtime.rowtap import RowPieces

from ._types import F64, I64, IdFn, row_id

__all__ = [
    "ID_KEYS",
    "EvenlyTap",
    "IdFn",
    "MetaBatch",
    "RowsTapper",
    "SplitCollate",
    "TagCollate",
    "TracedIterable",
    "TracedMap",
    "TracedStateful",
    "default_id",
    "draws_of",
    "metas_of",
    "received",
    "trace_evenly",
]

#: Keys looked up, in order, when a sample is a dict.
ID_KEYS = ("__key__", "idx", "id", "index")

#: ``(worker, id, random, numpy, torch, read)``, and for a packed row its pieces (``RowMeta``)
Meta = tuple[int, Any, float, float, float, int]
RowMeta = tuple[int, Any, float, float, float, int, I64]

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


def _traced(items: Iterator[Any], id_fn: IdFn) -> Iterator[tuple[Any, Meta]]:
    """``(sample, meta)`` for each sample."""
    worker = _worker_id()
    for sample in items:
        yield sample, _meta(worker, sample, id_fn)


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


class TracedStateful(TracedIterable):
    """A ``TracedIterable`` that forwards ``state_dict``/``load_state_dict`` (so torchdata's
    ``StatefulDataLoader`` saves and loads the wrapped dataset's state)."""

    def state_dict(self) -> Any:
        return self.inner.state_dict()

    def load_state_dict(self, state: Any) -> None:
        self.inner.load_state_dict(state)


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


class EvenlyTap:
    """The audit's tap on an ``evenly.Dataset``'s reads (``Planner.tap``): each sample
    leaves the reader as ``(sample, meta)``, in the process that read it, whichever loader
    drives the pass (the dataset's own passes, or ``evenly.DataLoader``'s hand-off);
    over an ``evenly.Mix``, ``meta`` also names the global index it was read from."""

    def __init__(self, id_fn: IdFn, records_reads: bool) -> None:
        self.id_fn = id_fn
        self.records_reads = records_reads

    def __call__(self, indices: list[int], samples: list[Any]) -> list[Any]:
        worker, id_fn, k = _worker_id(), self.id_fn, len(samples)
        reads = indices if self.records_reads else [UNKNOWN_READ] * k
        # One call per generator for the whole read batch (a per-sample torch.rand was
        # the audit's largest cost): the same streams still give the same draws.
        py, npy, tch = _draws(k)
        return [
            (sample, (worker, id_fn(sample), a, b, c, int(read)))
            for sample, a, b, c, read in zip(samples, py, npy, tch, reads, strict=True)
        ]


def _draws(k: int) -> tuple[list[float], list[float], list[float]]:
    """``k`` draws from each generator, one call per generator."""
    py = [random.random() for _ in range(k)]
    return py, np.random.random(k).tolist(), torch.rand(k, dtype=torch.float64).tolist()


class RowsTapper:
    """The audit's tap on packed rows (``Planner.rows_tap``): each row leaves the worker
    as ``(row, meta)``, ``meta`` ending with the row's pieces as an ``(n, 3)`` array of
    (document, absolute start, token count); its id is ``row_id`` of its first token
    (a pad row: ``-1 - row``)."""

    def __call__(self, rows: list[Any], seen: RowPieces) -> list[Any]:
        k = len(rows)
        worker = _worker_id()
        py, npy, tch = _draws(k)
        bounds = np.searchsorted(seen.piece_row, np.arange(k + 1)).tolist()
        table = np.stack([seen.doc, seen.start, seen.length], axis=1)
        out = []
        for i, row in enumerate(rows):
            a, b = bounds[i], bounds[i + 1]
            pieces = table[a:b]
            first = -1 - int(seen.row[i]) if b == a else row_id(int(table[a, 0]), int(table[a, 1]))
            out.append((row, (worker, first, py[i], npy[i], tch[i], UNKNOWN_READ, pieces)))
        return out


def trace_evenly(dataset: EvenlyDataset[Any], id_fn: IdFn) -> EvenlyDataset[Any]:
    """Make ``dataset`` yield ``(sample, meta)`` while staying what it is (the taps live
    on its planner, so workers started by any method get them with the dataset).  Its
    reader strategy calls the tap of its unit: samples (``tap``), or packed rows with
    their pieces (``rows_tap``; ``id_fn`` is not used)."""
    planner = planner_of(dataset)
    planner.tap = EvenlyTap(id_fn, records_reads=isinstance(dataset.source, Mix))
    planner.rows_tap = RowsTapper()
    return dataset


#: One sample's meta as one record: a batch's metas travel as one array (one leaf for the
#: loader's transport, whatever the batch size), joined once per rank.
META = np.dtype(
    [
        ("worker", "<i8"),
        ("id", "<i8"),
        ("random", "<f8"),
        ("numpy", "<f8"),
        ("torch", "<f8"),
        ("read", "<i8"),
    ]
)


class MetaBatch(NamedTuple):
    """The metas of one batch: ``table``, one ``META`` record a sample; ``labels``, the
    ids when they are not all integers (else ``table["id"]`` holds them); for packed
    rows, ``pieces`` is ``(n, 4)``: (row in the batch, document, start, token count);
    ``unread``: why the collated batch could not be read (the reader's record kept);
    ``dropped``: the ids read for the batch that it does not hold."""

    table: npt.NDArray[np.void]
    labels: list[Any] | None = None
    pieces: I64 | None = None
    unread: str | None = None
    dropped: list[Any] | None = None

    @property
    def ids(self) -> I64 | list[Any]:
        """An int64 array when every id is an integer, else a list."""
        return np.asarray(self.table["id"]) if self.labels is None else self.labels

    @property
    def samples(self) -> int:
        """Samples in the batch."""
        return len(self.table)

    @classmethod
    def of(cls, metas: list[Meta] | list[RowMeta]) -> MetaBatch:
        """Columns from per-sample metas.

        >>> MetaBatch.of([(0, 5, 0.1, 0.2, 0.3, -1), (0, 6, 0.4, 0.5, 0.6, -1)]).ids
        array([5, 6])
        """
        if not metas:
            return cls(np.zeros(0, dtype=META))
        if len(metas[0]) == 6 and all(type(m[1]) is int for m in metas):
            return cls(np.array(metas, dtype=META))
        workers, ids, r, n, t, reads, *rest = zip(*metas, strict=True)
        ints = all(type(i) is int for i in ids)
        pieces = None
        if rest:  # packed rows: their pieces, each tagged with its row in the batch
            parts = [np.asarray(p, dtype=np.int64).reshape(-1, 3) for p in rest[0]]
            slots = np.repeat(np.arange(len(parts)), [len(p) for p in parts])
            pieces = np.column_stack([slots, np.concatenate(parts)]).astype(np.int64)
        table = np.zeros(len(metas), dtype=META)
        table["worker"], table["random"], table["numpy"], table["torch"] = workers, r, n, t
        table["read"] = reads
        if ints:
            table["id"] = ids
        return cls(table, None if ints else list(ids), pieces)


def draws_of(table: npt.NDArray[np.void]) -> F64:
    """The ``(k, 3)`` draws of ``META`` records, in ``GENERATORS`` order."""
    out: F64 = np.stack([table["random"], table["numpy"], table["torch"]], axis=1)
    return out.astype(np.float64, copy=False)


class SplitCollate:
    """Split ``(sample, meta)`` items into the user's collated batch and a ``MetaBatch``
    of what that batch holds (``received``): the loop's view, not the reader's."""

    def __init__(
        self, collate: Callable[[list[Any]], Any] | None, id_fn: IdFn | None = None
    ) -> None:
        self.collate = default_collate if collate is None else collate
        self.id_fn = default_id if id_fn is None else id_fn

    def __call__(self, items: list[tuple[Any, Meta]]) -> tuple[Any, MetaBatch]:
        samples = [s for s, _ in items]
        metas = MetaBatch.of([m for _, m in items])
        batch = self.collate(samples)
        return batch, received(batch, samples, metas, self.id_fn)


class TagCollate:
    """For a loader the audit cannot give a traced dataset (``LoaderFactory``): the metas
    are taken in the collate function, in the worker, from the raw samples.

    The batch is a dict whose first entry has one element per sample: loaders that count
    what they yield by the batch's length (MosaicML's ``StreamingDataLoader`` takes a
    dict's first value, else ``len(batch[0])``) count samples, as they would count the
    user's batch, so their saved position stays right.

    >>> tagged = TagCollate(default_id)([3, 4])
    >>> list(tagged), len(next(iter(tagged.values()))), metas_of(tagged).ids
    (['samples', 'batch', 'metas'], 2, array([3, 4]))
    """

    def __init__(self, id_fn: IdFn, collate: Callable[[list[Any]], Any] | None = None) -> None:
        self.id_fn = id_fn
        self.collate = default_collate if collate is None else collate

    def __call__(self, samples: list[Any]) -> dict[str, Any]:
        worker = _worker_id()
        metas = MetaBatch.of([_meta(worker, s, self.id_fn) for s in samples])
        batch = self.collate(samples)
        # "samples" stays what the loader read (its own position counts those)
        seen = received(batch, samples, metas, self.id_fn)
        return {"samples": metas.table, "batch": batch, "metas": seen}


def metas_of(item: Any) -> MetaBatch:
    """The ``MetaBatch`` of a batch the audit's collate made (``SplitCollate``'s
    ``(batch, metas)`` or ``TagCollate``'s dict)."""
    if isinstance(item, dict):
        metas: MetaBatch = item["metas"]
        return metas
    return item[1]  # type: ignore[no-any-return]


# ---- what the loop received -----------------------------------------------------------
# The metas are taken where the samples are read; the user's collate_fn may still drop,
# repeat or change samples on their way to the loop.  ``received`` keeps the records of
# what the collated batch holds: the samples whose ids it holds (read back from the batch
# with the id function), or, for packed rows, the pieces whose tokens it holds unchanged.


def _unread(metas: MetaBatch, why: str) -> MetaBatch:
    return metas._replace(unread=why)


def _column(value: Any) -> list[Any] | None:
    """The per-sample entries of one collated field (None: not a per-sample field)."""
    if isinstance(value, torch.Tensor | np.ndarray):
        return None if value.ndim == 0 else list(value)
    if isinstance(value, list | tuple):
        return list(value)
    return None


def uncollate(batch: Any) -> list[Any]:
    """The samples of a collated batch, as far as its structure tells: a tensor's rows,
    a dict of columns as one dict a sample, a list of columns zipped, a list of samples.

    >>> [s["idx"].item() for s in uncollate({"idx": torch.tensor([3, 4]), "n": 2})]
    [3, 4]
    >>> uncollate(["a/1", "a/2"])
    ['a/1', 'a/2']
    >>> [int(y) for _, y in uncollate([torch.zeros(2, 5), torch.tensor([7, 8])])]
    [7, 8]
    """
    if isinstance(batch, Mapping):
        columns = {k: c for k, c in ((k, _column(v)) for k, v in batch.items()) if c is not None}
        sizes = [len(c) for c in columns.values()]
        if not sizes:
            raise TypeError("a dict with no per-sample field")
        n = max(set(sizes), key=sizes.count)  # fields of another length are not per sample
        kept = {k: c for k, c in columns.items() if len(c) == n}
        return [{k: c[i] for k, c in kept.items()} for i in range(n)]
    if isinstance(batch, list | tuple):
        fields = [_column(v) for v in batch]
        if batch and all(isinstance(v, torch.Tensor | np.ndarray) for v in batch):
            lengths = {len(f) for f in fields if f is not None}
            if len(lengths) == 1 and all(f is not None for f in fields):
                n = lengths.pop()
                return [tuple(f[i] for f in fields if f is not None) for i in range(n)]
        return list(batch)
    column = _column(batch)
    if column is None:
        raise TypeError(f"a {type(batch).__name__} is not a batch of samples")
    return column


def _fast_ids(batch: Any) -> list[Any] | None:
    """The ids of a default-collated batch of default ids in one call (None: not one)."""
    if isinstance(batch, torch.Tensor) and batch.ndim == 1 and not batch.is_floating_point():
        return batch.tolist()  # type: ignore[no-any-return]
    if isinstance(batch, Mapping):
        for key in ID_KEYS:
            if key in batch:
                return _fast_ids(batch[key])
        return None
    if isinstance(batch, list) and all(type(v) is str for v in batch):
        return batch
    return None


def batch_ids(batch: Any, id_fn: IdFn) -> list[Any]:
    """The id of each sample the collated ``batch`` holds (raises where it cannot tell).

    >>> batch_ids(torch.tensor([5, 6]), default_id), batch_ids({"__key__": ["a", "b"]}, default_id)
    ([5, 6], ['a', 'b'])
    """
    fast = _fast_ids(batch) if id_fn is default_id else None
    if fast is not None:
        return fast
    ids = [id_fn(sample) for sample in uncollate(batch)]
    # an id_fn applied to a collated sample may give a tensor
    scalar = torch.Tensor | np.ndarray | np.generic
    return [default_id(i) if isinstance(i, scalar) else i for i in ids]


def _take(metas: MetaBatch, ids: list[Any]) -> MetaBatch:
    """The records of the samples ``ids`` names, in its order: each the next unused
    record with that id (an id the reader produced fewer times reuses its last record;
    one it never produced takes the batch's first record, with that id)."""
    have = metas.ids
    have_list = have.tolist() if isinstance(have, np.ndarray) else list(have)
    free: dict[Any, list[int]] = {}
    for i, v in enumerate(have_list):
        free.setdefault(v, []).append(i)
    last: dict[Any, int] = {}
    take = []
    for v in ids:
        queue = free.get(v)
        if queue:
            last[v] = queue.pop(0)
        take.append(last.get(v, 0))
    dropped = [have_list[i] for i in sorted(i for queue in free.values() for i in queue)]
    table = metas.table[np.asarray(take, dtype=np.int64)]
    if all(type(v) is int for v in ids):
        table["id"] = ids
        return metas._replace(table=table, labels=None, dropped=dropped)
    return metas._replace(table=table, labels=list(ids), dropped=dropped)


def received(batch: Any, samples: list[Any], metas: MetaBatch, id_fn: IdFn) -> MetaBatch:
    """``metas`` reduced to what the collated ``batch`` holds (see ``batch_ids`` and
    ``received_rows``); where the batch cannot be read, the reader's ``metas`` with
    ``unread`` saying why."""
    if metas.pieces is not None:
        return received_rows(batch, samples, metas)
    try:
        ids = batch_ids(batch, id_fn)
    except Exception as exc:
        return _unread(metas, f"{type(exc).__name__}: {exc}")
    have = metas.table["id"].tolist() if metas.labels is None else metas.labels
    if have == ids:
        return metas  # the batch holds what was read
    read = set(have)
    if not ids:
        return _take(metas, ids) if read else metas
    if not any(i in read for i in ids):
        shown = ", ".join(repr(i) for i in ids[:3])
        return _unread(metas, f"its ids ({shown}...) are none of the samples read")
    return _take(metas, ids)


def _tokens(row: Any) -> torch.Tensor | None:
    value = row.get("input_ids") if isinstance(row, Mapping) else None
    return value if isinstance(value, torch.Tensor) else None


def received_rows(batch: Any, rows: list[Any], metas: MetaBatch) -> MetaBatch:
    """Packed rows: the pieces whose tokens the collated batch's ``input_ids`` holds
    unchanged.  Row for row when the batch has as many rows (a changed token cuts its
    piece: the tokens around it stay received); otherwise each row the batch holds
    unchanged, in the batch's order (a row it lost or changed: its pieces missing)."""
    got = batch.get("input_ids") if isinstance(batch, Mapping) else None
    before = [_tokens(row) for row in rows]
    if not isinstance(got, torch.Tensor) or got.ndim != 2 or any(t is None for t in before):
        what = type(got).__name__ if isinstance(batch, Mapping) else type(batch).__name__
        return _unread(metas, f"no 2-D input_ids tensor in the collated batch (a {what})")
    sent = [t for t in before if t is not None]
    pieces = metas.pieces
    assert pieces is not None
    if got.shape[0] != len(sent):
        return _matched_rows(got, sent, metas, pieces)
    changed = [
        i for i, t in enumerate(sent) if t.shape != got[i].shape or not torch.equal(t, got[i])
    ]
    if not changed:
        return metas
    offsets = _offsets(pieces)
    keep: list[I64] = [pieces[~np.isin(pieces[:, 0], changed)]]
    for i in changed:
        t, g = sent[i], got[i]
        n = min(len(t), len(g))
        same = np.zeros(len(t), dtype=np.bool_)
        same[:n] = (t[:n] == g[:n]).numpy()
        for j in np.flatnonzero(pieces[:, 0] == i).tolist():
            slot, doc, start, length = pieces[j].tolist()
            at = int(offsets[j])
            ok = np.r_[False, same[at : at + length], False].astype(np.int8)
            edges = np.flatnonzero(np.diff(ok))  # runs of unchanged tokens: [a, b) pairs
            for a, b in zip(edges[::2].tolist(), edges[1::2].tolist(), strict=True):
                keep.append(np.array([[slot, doc, start + a, b - a]], dtype=np.int64))
    kept = np.concatenate(keep)
    return metas._replace(pieces=kept[np.argsort(kept[:, 0], kind="stable")])


def _offsets(pieces: I64) -> I64:
    """Each piece's first position in its row (pieces are in row order)."""
    ends = np.cumsum(pieces[:, 3])
    starts = ends - pieces[:, 3]
    first = np.r_[True, pieces[1:, 0] != pieces[:-1, 0]] if len(pieces) else np.zeros(0, bool)
    out: I64 = starts - np.maximum.accumulate(np.where(first, starts, 0))
    return out


def _matched_rows(
    got: torch.Tensor, sent: list[torch.Tensor], metas: MetaBatch, pieces: I64
) -> MetaBatch:
    """The rows of ``sent`` that ``got`` holds unchanged, in ``got``'s order."""
    free = list(range(len(sent)))
    take = []
    for row in got:
        hit = next(
            (i for i in free if sent[i].shape == row.shape and torch.equal(sent[i], row)), None
        )
        if hit is not None:
            free.remove(hit)
            take.append(hit)
    parts = [pieces[pieces[:, 0] == i] for i in take]
    for slot, part in enumerate(parts):
        part[:, 0] = slot
    kept = np.concatenate(parts) if parts else np.zeros((0, 4), dtype=np.int64)
    table = metas.table[np.asarray(take, dtype=np.int64)]
    labels = None if metas.labels is None else [metas.labels[i] for i in take]
    return metas._replace(table=table, labels=labels, pieces=kept)
