"""Pure computations of each finding from the collected ``Records`` (numpy only).

Every function takes ``Records`` and returns one ``Finding``; ``all_findings`` runs them
in report order.  Thresholds are module constants so the docs can quote them.

>>> import numpy as np
>>> from evenly.audit._types import Records
>>> ids = np.array([0, 1, 0, 1])
>>> zeros = np.zeros(4, dtype=np.int64)
>>> rec = Records(ids=ids, rank=zeros, worker=np.array([0, 0, 1, 1]), epoch=zeros,
...               batch=np.array([0, 0, 1, 1]), pos=np.array([0, 1, 0, 1]),
...               draws=np.random.default_rng(0).random((4, 3)), per_rank=[],
...               world_size=1, num_workers=2, epochs=1, batch_size=2, expected=2)
>>> duplicates(rec).detail
'epoch 0: 2 extra deliveries, every sample delivered 2x'
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import replace

import numpy as np

from ._mixfindings import mix_counts, stream_duplicates, stream_missing
from ._packfindings import full_batches, pad_rows, tokens
from ._shuffle import adjacency, repeated_order, shuffle_quality, spearman
from ._types import GENERATORS, Finding, Records, Status, batch_sizes, epochs_of, unique_rows

__all__ = [
    "adjacency",
    "all_findings",
    "compact",
    "duplicates",
    "length",
    "missing",
    "partial_batches",
    "rank_balance",
    "repeated_order",
    "rng_streams",
    "shuffle_quality",
    "spearman",
]

#: Draws compared per stream when looking for shared random streams.
RNG_PREFIX = 8

#: Sample ids named per finding part.
SHOWN_IDS = 5


def _worst(statuses: list[Status]) -> Status:
    for status in ("FAIL", "WARN"):
        if status in statuses:
            return status  # type: ignore[return-value]
    return "PASS"


def duplicates(rec: Records) -> Finding:
    """Samples delivered more than once in an epoch, across all ranks and workers.

    A few duplicates (fewer than ``world_size``) are what padding to equal ranks costs
    (``DistributedSampler``, ``evenly.Dataset(drop_last=False)``): WARN. More: FAIL.
    """
    parts: list[str] = []
    worst = 0
    for e in epochs_of(rec):
        ids = rec.ids[rec.epoch == e]
        if len(ids) == 0:
            continue
        _, counts = np.unique(ids, return_counts=True)
        extra = int(len(ids) - len(counts))
        worst = max(worst, extra)
        if extra == 0:
            continue
        if counts.min() == counts.max():
            parts.append(
                f"epoch {e}: {extra} extra deliveries, every sample delivered {int(counts[0])}x"
            )
        else:
            n_dup = int((counts > 1).sum())
            parts.append(
                f"epoch {e}: {extra} extra deliveries, {n_dup} samples delivered "
                f"more than once (up to {int(counts.max())}x)"
            )
    if worst == 0:
        return Finding(
            "duplicates",
            "Duplicates",
            "PASS",
            0,
            "every sample delivered at most once per epoch",
        )
    status: Status = "WARN" if worst < rec.world_size else "FAIL"
    if status == "WARN":
        parts.append("(fewer than world_size: padding so every rank gets the same count)")
    return Finding("duplicates", "Duplicates", status, worst, "; ".join(parts))


def missing(rec: Records) -> Finding:
    """Samples never delivered in an epoch, against ``rec.expected`` (or, unknown, the
    union of ids over all epochs)."""
    reference = rec.expected
    source = rec.expected_source
    if reference is None:
        reference = len(np.unique(rec.ids))
        source = "ids seen over all epochs"
    parts: list[str] = []
    worst = 0
    statuses: list[Status] = []
    for e in epochs_of(rec):
        seen = len(np.unique(rec.ids[rec.epoch == e]))
        gap = reference - seen
        if gap > 0:
            parts.append(
                f"epoch {e}: {gap} of {reference} never delivered ({seen} seen"
                f"{_dropped(rec.dropped.get(e, []))})"
            )
            statuses.append("FAIL")
        elif gap < 0:
            parts.append(f"epoch {e}: {seen} distinct samples, more than the {reference} expected")
            statuses.append("FAIL")
        worst = max(worst, abs(gap))
    if not parts:
        parts.append(f"all {reference} samples delivered every epoch")
    return Finding("missing", f"Missing (vs {source})", _worst(statuses), worst, "; ".join(parts))


def _dropped(names: list[str]) -> str:
    """The samples read but left out of the collated batches, named."""
    if not names:
        return ""
    shown = ", ".join(names[:SHOWN_IDS]) + (", ..." if len(names) > SHOWN_IDS else "")
    return f", {len(names)} read but not in the batches collate_fn returned: {shown}"


def rank_balance(rec: Records) -> Finding:
    """Samples and batches per rank per epoch: unequal batch counts hang DDP (FAIL),
    unequal sample counts with equal batches weigh ranks unequally (WARN)."""
    parts: list[str] = []
    statuses: list[Status] = []
    worst = 0
    for e in epochs_of(rec):
        rows = sorted((r for r in rec.per_rank if r.epoch == e), key=lambda r: r.rank)
        if not rows:
            continue
        batches = [r.batches for r in rows]
        samples = [r.samples for r in rows]
        if len(set(batches)) > 1:
            statuses.append("FAIL")
            worst = max(worst, max(batches) - min(batches))
            parts.append(f"epoch {e}: batches per rank {batches} (DDP hang risk)")
        elif len(set(samples)) > 1:
            statuses.append("WARN")
            parts.append(f"epoch {e}: samples per rank {samples}, batches equal {batches[0]}")
    if not parts:
        first = [r for r in rec.per_rank if r.epoch == 0]
        each = f"{first[0].samples} samples, {first[0].batches} batches" if first else "0"
        parts.append(f"every rank: {each} per epoch")
    return Finding("rank_balance", "Rank balance", _worst(statuses), worst, "; ".join(parts))


def partial_batches(rec: Records) -> Finding:
    """Batches smaller than ``batch_size``: a map-style loader gives at most one per rank
    per epoch; more means each worker batches its own leftovers (WARN)."""
    ranks, epochs, sizes = batch_sizes(rec)
    partial = sizes < rec.batch_size
    worst = 0
    parts: list[str] = []
    for e in epochs_of(rec):
        per_rank = [
            int((partial & (ranks == r) & (epochs == e)).sum()) for r in range(rec.world_size)
        ]
        worst = max(worst, *per_rank)
        if max(per_rank) > 1:
            parts.append(f"epoch {e}: partial batches per rank {per_rank}")
    status: Status = "WARN" if worst > 1 else "PASS"
    if not parts:
        parts.append(f"at most {worst} partial batch(es) per rank per epoch")
    return Finding("partial_batches", "Partial batches", status, worst, "; ".join(parts))


def rng_streams(rec: Records) -> Finding:
    """Workers or ranks whose random draws after each sample are the same sequence: they
    apply the same "random" augmentations (FAIL).  Equal across epochs only: WARN."""
    if len(rec) == 0:
        return Finding("rng_streams", "RNG streams", "PASS", 0, "no samples")
    streams, inverse, lengths = unique_rows(rec.rank, rec.epoch, rec.worker)
    k = int(min(RNG_PREFIX, lengths.min()))
    first = np.full((len(streams), k, len(GENERATORS)), np.nan)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    by_stream = np.argsort(inverse, kind="stable")
    for j in range(k):
        pick = by_stream[starts + j]
        first[:, j, :] = rec.draws[pick]
    clashes: dict[str, set[tuple[int, int]]] = {"workers": set(), "ranks": set(), "epochs": set()}
    shared_by: dict[str, set[str]] = {"workers": set(), "ranks": set(), "epochs": set()}
    for g, name in enumerate(GENERATORS):
        sig: dict[bytes, list[int]] = {}
        for s in range(len(streams)):
            sig.setdefault(first[s, :, g].tobytes(), []).append(s)
        for members in sig.values():
            for i, a in enumerate(members):
                for b in members[i + 1 :]:
                    (ra, ea, _), (rb, eb, _) = streams[a], streams[b]
                    kind = "epochs" if ea != eb else ("ranks" if ra != rb else "workers")
                    clashes[kind].add((a, b))
                    shared_by[kind].add(name)
    n_bad = len(clashes["workers"]) + len(clashes["ranks"])
    if n_bad == 0 and not clashes["epochs"]:
        return Finding(
            "rng_streams",
            "RNG streams",
            "PASS",
            0,
            f"{len(streams)} (rank, worker, epoch) streams, all different",
        )
    parts = [
        f"{len(pairs)} pairs of streams equal across {kind} "
        f"({'/'.join(g for g in GENERATORS if g in shared_by[kind])})"
        for kind, pairs in clashes.items()
        if pairs
    ]
    status: Status = "FAIL" if n_bad else "WARN"
    return Finding(
        "rng_streams",
        "RNG streams",
        status,
        n_bad + len(clashes["epochs"]),
        "; ".join(parts),
    )


def length(rec: Records) -> Finding:
    """``len(dataset)``/``len(sampler)`` and ``len(loader)`` against what each rank
    delivered per epoch: a lie is FAIL, no length at all is WARN."""
    parts: list[str] = []
    statuses: list[Status] = []
    worst = 0
    unknown = 0
    for r in sorted(rec.per_rank, key=lambda x: (x.epoch, x.rank)):
        if r.reported_len is None and r.reported_batches is None:
            unknown += 1
            continue
        if r.reported_len is not None and r.reported_len != r.samples:
            statuses.append("FAIL")
            worst = max(worst, abs(r.reported_len - r.samples))
            parts.append(
                f"rank {r.rank} epoch {r.epoch}: len() {r.reported_len}, yielded {r.samples}"
            )
        elif r.reported_batches is not None and r.reported_batches != r.batches:
            statuses.append("FAIL")
            worst = max(worst, abs(r.reported_batches - r.batches))
            parts.append(
                f"rank {r.rank} epoch {r.epoch}: len(loader) {r.reported_batches}, "
                f"yielded {r.batches} batches"
            )
    if unknown:
        statuses.append("WARN")
        parts.append(f"{unknown} rank-epochs without len(): the length of an epoch is unknown")
    if not parts:
        parts.append("len() matches what every rank yielded")
    return Finding("length", "len() vs yielded", _worst(statuses), worst, "; ".join(parts))


_ALL: tuple[Callable[[Records], Finding], ...] = (
    duplicates,
    missing,
    rank_balance,
    partial_batches,
    repeated_order,
    shuffle_quality,
    adjacency,
    rng_streams,
    length,
)


#: For an ``evenly.Mix``: duplicates and missing judged per source stream (a Mix repeats
#: samples by design), and the samples per source per epoch after them.
_MIX: dict[Callable[[Records], Finding], tuple[Callable[[Records], Finding], ...]] = {
    duplicates: (stream_duplicates,),
    missing: (stream_missing, mix_counts),
}


#: For a packed dataset: every token once instead of every sample once, the pad rows,
#: and full-shape batches instead of partial ones.
_PACK: dict[Callable[[Records], Finding], tuple[Callable[[Records], Finding], ...]] = {
    duplicates: (tokens,),
    missing: (pad_rows,),
    partial_batches: (full_batches,),
}


def all_findings(rec: Records) -> list[Finding]:
    """Every finding, in report order (adjacency only when ``rec.shards`` is set; for a
    Mix, ``mix_counts`` and per-stream duplicates/missing; for a packed dataset,
    ``tokens``, ``pad_rows`` and ``full_batches``), with details that repeat over epochs
    or ranks merged (see ``compact``)."""
    checks = [f for f in _ALL if f is not adjacency or rec.shards is not None]
    if rec.mix is not None:
        checks = [g for f in checks for g in _MIX.get(f, (f,))]
    if rec.pack is not None:
        checks = [g for f in checks for g in _PACK.get(f, (f,))]
    found = [f(rec) for f in checks]
    return [replace(f, detail=compact(f.detail)) for f in found]


_PART = re.compile(r"^(?:rank (?P<rank>\d+) )?epoch (?P<epoch>\d+): (?P<text>.*)$")


def _span(values: list[int], word: str) -> str:
    values = sorted(set(values))
    if len(values) == 1:
        return f"{word} {values[0]}"
    if values == list(range(values[0], values[-1] + 1)):
        return f"{word}s {values[0]}-{values[-1]}"
    return f"{word}s {','.join(map(str, values))}"


def compact(detail: str) -> str:
    """Merge ``"epoch 0: X; epoch 1: X"`` into ``"epochs 0-1: X"`` (and the same for
    ``"rank R epoch E: X"`` parts that cover every rank x epoch combination).

    >>> compact("epoch 0: 4x; epoch 1: 4x; epoch 2: 2x")
    'epochs 0-1: 4x; epoch 2: 2x'
    >>> compact("rank 0 epoch 0: len 5; rank 1 epoch 0: len 5")
    'ranks 0-1 epoch 0: len 5'
    """
    groups: dict[tuple[bool, str], list[tuple[int, int]]] = {}
    others: list[str] = []
    order: list[tuple[bool, str] | str] = []
    for part in detail.split("; "):
        m = _PART.match(part)
        if m is None:
            others.append(part)
            order.append(part)
            continue
        key = (m["rank"] is not None, m["text"])
        if key not in groups:
            groups[key] = []
            order.append(key)
        groups[key].append((int(m["rank"] or 0), int(m["epoch"])))
    out: list[str] = []
    for item in order:
        if isinstance(item, str):
            out.append(item)
            continue
        has_rank, text = item
        pairs = groups[item]
        ranks = sorted({r for r, _ in pairs})
        epochs = sorted({e for _, e in pairs})
        if has_rank and len(ranks) * len(epochs) != len(set(pairs)):
            out.extend(f"rank {r} epoch {e}: {text}" for r, e in pairs)
            continue
        where = _span(epochs, "epoch")
        out.append(f"{_span(ranks, 'rank')} {where}: {text}" if has_rank else f"{where}: {text}")
    return "; ".join(out)
