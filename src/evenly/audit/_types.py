"""The values the audit passes around: its settings, what was recorded, what was found.

Pure data on numpy only, so that ``import evenly`` stays light.  ``Records`` holds one
row per delivered sample (numpy columns, so every finding is a vectorised, pure
computation) and one ``RankEpoch`` per (rank, epoch) with what the loader *claimed*
(``len()``) next to what it delivered.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

__all__ = [
    "GENERATORS",
    "AuditError",
    "Finding",
    "IdFn",
    "LoaderFactory",
    "MixInfo",
    "PackInfo",
    "RankEpoch",
    "Records",
    "Settings",
    "Status",
    "batch_sizes",
    "epochs_of",
    "passed",
    "ranks_per_node",
    "row_id",
    "row_label",
    "stacked",
    "unique_rows",
]

I64 = npt.NDArray[np.int64]
F64 = npt.NDArray[np.float64]

Status = Literal["PASS", "WARN", "FAIL"]

#: Names a sample (``evenly.audit.default_id`` by default).
IdFn = Callable[[Any], Any]

#: The generators a draw is taken from after each sample, in the column order of ``draws``.
GENERATORS = ("random", "numpy", "torch")


class AuditError(RuntimeError):
    """The audit could not run: a factory that does not import, a rank that failed, a
    timeout, or a report that needs ``pip install 'evenly[report]'``."""


@dataclass(frozen=True)
class LoaderFactory:
    """What a factory returns for a data loader that makes its own loader (litdata's or
    MosaicML's ``StreamingDataLoader``, a user's own): ``make(batch_size=, num_workers=,
    collate_fn=)`` builds the rank's loader; ``dataset`` (optional) is asked for
    ``len()`` and ``set_epoch``.  The audit passes a ``collate_fn`` that records each
    batch's samples; wrap your own collate with ``functools.partial`` if you need one.

    >>> LoaderFactory(make=dict).make(batch_size=2, num_workers=0, collate_fn=None)
    {'batch_size': 2, 'num_workers': 0, 'collate_fn': None}
    """

    make: Callable[..., Any]
    dataset: Any = None


@dataclass(frozen=True)
class Settings:
    """The topology and loop of an audit."""

    num_workers: int
    world_size: int
    epochs: int
    batch_size: int
    timeout: float = 300.0
    #: for a resume audit: extra stops, as fractions of the first epoch's batches
    resume_at: tuple[float, ...] = ()
    #: ``loader.set_weights(weights)`` after batch ``batch`` of epoch ``epoch``, on every
    #: rank: ``(epoch, batch, ((name, weight), ...))``
    set_weights: tuple[tuple[int, int, tuple[tuple[str, float], ...]], ...] = ()
    #: simulated nodes the ranks are split over (``world_size / nodes`` ranks each)
    nodes: int = 1

    def weights_after(self, epoch: int, batch: int) -> dict[str, float] | None:
        """The weights to set after batch ``batch`` of ``epoch`` (None: no change)."""
        for e, b, weights in self.set_weights:
            if (e, b) == (epoch, batch):
                return dict(weights)
        return None


@dataclass(frozen=True)
class Finding:
    """One check: its verdict and the number behind it.

    >>> Finding("duplicates", "Duplicates", "FAIL", 200.0, "epoch 0: every sample 2x").status
    'FAIL'
    """

    name: str
    title: str
    status: Status
    value: float
    detail: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "title": self.title,
            "status": self.status,
            "value": self.value,
            "detail": self.detail,
        }


def passed(findings: Sequence[Finding]) -> bool:
    """Whether an audit with these findings is OK: no finding is FAIL.

    >>> passed([Finding("missing", "Missing", "WARN", 1.0, "unknown size")])
    True
    """
    return all(f.status != "FAIL" for f in findings)


@dataclass(frozen=True)
class RankEpoch:
    """What one rank's loader delivered in one epoch, and what its ``len()`` said.

    ``reported_len`` is ``len(dataset)`` for an iterable dataset, ``len(sampler)`` for a
    map-style one; ``reported_batches`` is ``len(loader)``; either is ``None`` when the
    object has no length.
    """

    rank: int
    epoch: int
    samples: int
    batches: int
    reported_len: int | None
    reported_batches: int | None


@dataclass(frozen=True)
class MixInfo:
    """The ``evenly.Mix`` an audited ``evenly.Dataset`` reads: its sources' names and
    lengths, the samples each contributes per epoch, and each stream's offset at the
    start of every audited epoch (index ``e`` of ``offsets``).

    >>> MixInfo(("web", "code"), (7, 3), (8, 2), ((0, 0), (8, 2))).source_of([0, 6, 7, 9])
    array([0, 0, 1, 1])
    """

    names: tuple[str, ...]
    lengths: tuple[int, ...]
    counts: tuple[int, ...]
    offsets: tuple[tuple[int, ...], ...]
    #: ``set_weights`` calls the audit made: ``(epoch, global position, weights)``
    changes: tuple[tuple[int, int, tuple[float, ...]], ...] = ()
    #: per source, how far a count at a global step boundary may be from its share
    bounds: tuple[float, ...] = ()

    def source_of(self, indices: Any) -> I64:
        """The source number of each global index (the concatenation of the sources)."""
        ends = np.cumsum(np.asarray(self.lengths, dtype=np.int64))
        out: I64 = np.searchsorted(ends, np.asarray(indices, dtype=np.int64), side="right")
        return out.astype(np.int64)

    def to_dict(self) -> dict[str, Any]:
        return {
            "sources": list(self.names),
            "lengths": dict(zip(self.names, self.lengths, strict=True)),
            "counts_per_epoch": dict(zip(self.names, self.counts, strict=True)),
        }


def row_id(doc: int, start: int) -> int:
    """The id of a packed row: its first token, as (document, token) in one integer
    (documents in order, so a document order that is not shuffled shows).

    >>> row_id(3, 5), row_label(row_id(3, 5)), row_label(-2)
    (12884901893, 'document 3 token 5', 'pad row 1')
    """
    return (doc << ROW_SHIFT) | start


def row_label(code: int) -> str:
    """What ``row_id`` (or a pad row's ``-1 - row``) names."""
    if code < 0:
        return f"pad row {-1 - code}"
    return f"document {code >> ROW_SHIFT} token {code & ((1 << ROW_SHIFT) - 1)}"


#: Bits of a row id that hold the token (a piece's start is an int32).
ROW_SHIFT = 32


@dataclass(frozen=True)
class PackInfo:
    """The packing of an audited ``evenly.Dataset(pack=...)``: tokens per row, its pad
    mode, every document's token count (by source index) and each audited epoch's rows.

    >>> PackInfo(8, "repeat", np.array([3, 9]), (2, 2)).tokens
    12
    """

    seq_len: int
    pad: str
    lengths: I64
    rows: tuple[int, ...]
    #: a Mix by tokens: each epoch's planned pieces ``(doc, start, len)`` (its documents
    #: are not each delivered once); ``None``: every document once per epoch
    expected: tuple[tuple[I64, I64, I64], ...] | None = None

    @property
    def tokens(self) -> int:
        """Tokens an epoch holds (every document's, once)."""
        return int(self.lengths.sum())

    def to_dict(self) -> dict[str, Any]:
        return {
            "seq_len": self.seq_len,
            "pad": self.pad,
            "documents": len(self.lengths),
            "tokens_per_epoch": self.tokens,
            "rows_per_epoch": list(self.rows),
        }


@dataclass
class Records:
    """Every delivered sample of an audit, as parallel columns in delivery order per rank.

    ``ids`` are integer codes: the ids themselves when every id is an integer, else the
    index of the id in ``labels`` (the sorted distinct ids).  ``shards`` is the group of
    each sample (from ``shard_fn``) or ``None``.  ``expected`` is how many distinct
    samples an epoch should deliver across all ranks (``None``: unknown, and the union of
    ids seen over all epochs stands in for it).  For an ``evenly.Dataset`` over an
    ``evenly.Mix``, ``mix`` describes the mixture and ``reads`` holds the global index
    (into the concatenated sources) each sample was read from, ``-1`` when unknown.
    For a packed dataset (``pack``), a row is a sample (its id: its first token, see
    ``row_id``) and ``pieces`` holds every row's pieces, ``(n, 4)``:
    (row of these records, document, absolute start, token count).  ``dropped`` names,
    per epoch, the samples read but not in the collated batches the loop received.
    """

    ids: I64
    rank: I64
    worker: I64
    epoch: I64
    batch: I64
    pos: I64
    draws: F64
    per_rank: list[RankEpoch]
    world_size: int
    num_workers: int
    epochs: int
    batch_size: int
    expected: int | None = None
    expected_source: str = "unknown"
    labels: list[str] | None = None
    shards: I64 | None = None
    warnings: list[str] = field(default_factory=list)
    mix: MixInfo | None = None
    reads: I64 | None = None
    pack: PackInfo | None = None
    pieces: I64 | None = None
    dropped: dict[int, list[str]] = field(default_factory=dict)
    #: simulated nodes, and per rank what it saw of its place (see ``_launch.seen_here``)
    nodes: int = 1
    seen: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = len(self.ids)
        for name in ("rank", "worker", "epoch", "batch", "pos"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"Records.{name} has {len(getattr(self, name))} rows, ids {n}")
        if self.draws.shape != (n, len(GENERATORS)):
            raise ValueError(f"Records.draws must have shape ({n}, 3), got {self.draws.shape}")
        if self.shards is not None and len(self.shards) != n:
            raise ValueError(f"Records.shards has {len(self.shards)} rows, ids {n}")
        if (self.mix is None) != (self.reads is None):
            raise ValueError("Records.mix and Records.reads go together: set both or neither")
        if self.reads is not None and len(self.reads) != n:
            raise ValueError(f"Records.reads has {len(self.reads)} rows, ids {n}")
        if (self.pack is None) != (self.pieces is None):
            raise ValueError("Records.pack and Records.pieces go together: set both or neither")

    def __len__(self) -> int:
        return len(self.ids)

    def label(self, code: int) -> str:
        """The id as the user knows it."""
        if self.pack is not None:
            return row_label(code)
        return str(code) if self.labels is None else self.labels[code]

    def layout(self) -> str:
        """The node layout, as the ranks saw it: nodes x ranks, and their host names.

        >>> empty = np.zeros(0, dtype=np.int64)
        >>> rec = Records(ids=empty, rank=empty, worker=empty, epoch=empty, batch=empty,
        ...               pos=empty, draws=np.zeros((0, 3)), per_rank=[], world_size=4,
        ...               num_workers=0, epochs=1, batch_size=2, nodes=2, seen=[
        ...                   {"rank": r, "node": r // 2, "host": f"evenly-node-{r // 2}",
        ...                    "host_note": None} for r in range(4)])
        >>> print(rec.layout())
        2 nodes x 2 ranks (GROUP_RANK 0-1, LOCAL_RANK 0-1); hosts evenly-node-0, evenly-node-1
        """
        per_node = self.world_size // max(self.nodes, 1)
        if self.nodes == 1:
            return f"1 node x {per_node} rank(s)"
        ranks = "1 rank (GROUP_RANK" if per_node == 1 else f"{per_node} ranks (GROUP_RANK"
        local = "0" if per_node == 1 else f"0-{per_node - 1}"
        text = f"{self.nodes} nodes x {ranks} 0-{self.nodes - 1}, LOCAL_RANK {local})"
        hosts = list(dict.fromkeys(str(s.get("host")) for s in self.seen))
        notes = sorted({str(s["host_note"]) for s in self.seen if s.get("host_note")})
        if len(hosts) == self.nodes and not notes:
            return f"{text}; hosts {', '.join(hosts)}"
        why = f" ({'; '.join(notes)})" if notes else ""
        return f"{text}; one host name for all nodes, {', '.join(hosts)}{why}"

    def global_order(self) -> I64:
        """Row indices sorted as a DDP step sees them: (epoch, batch, rank, position)."""
        return np.lexsort((self.pos, self.rank, self.batch, self.epoch)).astype(np.int64)


def epochs_of(rec: Records) -> list[int]:
    """The epoch numbers of an audit."""
    return list(range(rec.epochs))


def unique_rows(*cols: I64) -> tuple[I64, I64, I64]:
    """``np.unique(np.stack(cols, 1), axis=0, return_inverse=True, return_counts=True)``
    on one packed int64 key (``axis=0`` sorts rows as objects: ~20x slower).

    >>> rows, inverse, counts = unique_rows(np.array([1, 0, 1]), np.array([2, 5, 2]))
    >>> rows.tolist(), inverse.tolist(), counts.tolist()
    ([[0, 5], [1, 2]], [1, 0, 1], [1, 2])
    """
    n = len(cols[0])
    if n == 0:
        empty = np.zeros(0, dtype=np.int64)
        return np.zeros((0, len(cols)), dtype=np.int64), empty, empty
    lows = [int(c.min()) for c in cols]
    spans = [int(c.max()) - lo + 1 for c, lo in zip(cols, lows, strict=True)]
    key = np.zeros(n, dtype=np.int64)
    for c, lo, span in zip(cols, lows, spans, strict=True):
        key = key * span + (c.astype(np.int64) - lo)
    uniq, inverse, counts = np.unique(key, return_inverse=True, return_counts=True)
    rows = np.zeros((len(uniq), len(cols)), dtype=np.int64)
    rest = uniq.copy()
    for j in range(len(cols) - 1, -1, -1):
        rows[:, j] = rest % spans[j] + lows[j]
        rest //= spans[j]
    return rows, inverse.reshape(-1).astype(np.int64), counts.astype(np.int64)


def stacked(results: Sequence[Any]) -> dict[str, Any]:
    """The columns of several ranks' results (``_collect.RankResult``) one after the
    other: ``rank``, ``worker``, ``epoch``, ``batch``, ``pos`` (int64) and ``draws``
    (``(n, 3)`` floats)."""
    empty = np.zeros(0, dtype=np.int64)
    names = ("worker", "epoch", "batch", "pos")
    cols = {n: [np.asarray(getattr(r, n), dtype=np.int64) for r in results] for n in names}
    out: dict[str, Any] = {n: np.concatenate(c or [empty]) for n, c in cols.items()}
    ranks = zip(results, cols["epoch"], strict=True)
    out["rank"] = np.concatenate(
        [np.full(len(e), r.rank, dtype=np.int64) for r, e in ranks] or [empty]
    )
    draws = [np.asarray(r.draws, dtype=np.float64).reshape(-1, 3) for r in results]
    out["draws"] = np.concatenate(draws or [np.zeros((0, 3))])
    return out


def batch_sizes(rec: Records) -> tuple[I64, I64, I64]:
    """(rank, epoch, size) of every batch with at least one sample."""
    if len(rec) == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    uniq, _, sizes = unique_rows(rec.epoch, rec.rank, rec.batch)
    return uniq[:, 1].astype(np.int64), uniq[:, 0].astype(np.int64), sizes.astype(np.int64)


def ranks_per_node(
    world_size: int, nodes: int, names: tuple[str, str] = ("world_size", "nodes")
) -> int:
    """The ranks of each of ``nodes`` simulated nodes; ``ValueError`` naming the settings
    (``names``: their keywords) when ``nodes`` is not a divisor of ``world_size``.

    >>> ranks_per_node(4, 2)
    2
    >>> try:
    ...     ranks_per_node(6, 4)
    ... except ValueError as exc:
    ...     print(str(exc).split(": ")[0])
    world_size 6 (--world-size) is not a multiple of nodes 4 (--nodes)
    """
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        flag = "--" + names[1].replace("_", "-")
        raise ValueError(f"{names[1]} ({flag}) must be an integer >= 1, got {nodes!r}")
    if world_size % nodes:
        fits = [str(n) for n in range(1, world_size + 1) if world_size % n == 0]
        listed = ", ".join(fits[:-1]) + f" or {fits[-1]}" if len(fits) > 1 else fits[0]
        flags = [f"--{n.replace('_', '-')}" for n in names]
        raise ValueError(
            f"{names[0]} {world_size} ({flags[0]}) is not a multiple of {names[1]} {nodes} "
            f"({flags[1]}): each simulated node runs {names[0]} / {names[1]} ranks, as "
            f"torchrun's --nproc-per-node; use {names[1]} {listed}, or a {names[0]} that "
            f"is a multiple of {nodes}"
        )
    return world_size // nodes
