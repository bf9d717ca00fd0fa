"""Pure computations of each finding from the collected ``Records`` (numpy only).

Every function takes ``Records`` and returns one ``Finding``; ``all_findings`` runs them
in report order, the coverage findings of the records' unit (samples, a Mix's shares or
tokens: ``_coverage``) first.  Thresholds are module constants so the docs can quote them.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import replace

import numpy as np

from ._coverage import checks as coverage_checks
from ._coverage import verdict
from ._shuffle import adjacency, repeated_order, shuffle_quality, spearman
from ._types import GENERATORS, I64, Finding, Records, Status, batch_sizes, epochs_of, unique_rows

__all__ = [
    "adjacency",
    "all_findings",
    "compact",
    "full_batches",
    "length",
    "partial_batches",
    "rank_balance",
    "repeated_order",
    "rng_streams",
    "shuffle_quality",
    "spearman",
]

#: Draws compared per stream when looking for shared random streams.
RNG_PREFIX = 8


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
    return Finding("rank_balance", "Rank balance", verdict(statuses), worst, "; ".join(parts))


def _short_batches(rec: Records) -> I64:
    """Batches smaller than ``batch_size`` per epoch and rank, shape ``(epochs, world_size)``."""
    ranks, epochs, sizes = batch_sizes(rec)
    rows = (sizes < rec.batch_size) & (epochs < rec.epochs) & (ranks < rec.world_size)
    out = np.zeros((rec.epochs, rec.world_size), dtype=np.int64)
    np.add.at(out, (epochs[rows], ranks[rows]), 1)
    return out


def partial_batches(rec: Records) -> Finding:
    """Batches smaller than ``batch_size``: a map-style loader gives at most one per rank
    per epoch; more means each worker batches its own leftovers (WARN)."""
    short = _short_batches(rec)
    worst = int(short.max(initial=0))
    parts = [
        f"epoch {e}: partial batches per rank {per_rank.tolist()}"
        for e, per_rank in enumerate(short)
        if per_rank.max(initial=0) > 1
    ]
    status: Status = "WARN" if worst > 1 else "PASS"
    if not parts:
        parts.append(f"at most {worst} partial batch(es) per rank per epoch")
    return Finding("partial_batches", "Partial batches", status, worst, "; ".join(parts))


def full_batches(rec: Records) -> Finding:
    """A packed dataset's batches: every batch holds ``batch_size`` rows (``pad='none'``:
    one partial batch per rank per epoch is a WARN) and no row more than ``seq_len``
    tokens."""
    if rec.pack is None or rec.pieces is None:
        raise ValueError("these findings need the records of an audit of a packed dataset")
    seq_len, none = rec.pack.seq_len, rec.pack.pad == "none"
    parts: list[str] = []
    statuses: list[Status] = []
    filled = np.bincount(rec.pieces[:, 0], weights=rec.pieces[:, 3], minlength=len(rec))
    over = int((filled > seq_len).sum())
    if over:
        statuses.append("FAIL")
        parts.append(f"{over} rows hold more than seq_len={seq_len} tokens")
    for e, per_rank in enumerate(_short_batches(rec)):
        if not per_rank.any():
            continue
        ok = none and per_rank.max() <= 1
        statuses.append("WARN" if ok else "FAIL")
        parts.append(
            f"epoch {e}: batches with fewer than {rec.batch_size} rows per rank "
            f"{per_rank.tolist()}" + (" (pad='none')" if ok else "")
        )
    ok_text = f"every batch {rec.batch_size} rows of at most {seq_len} tokens"
    return Finding(
        "full_batches",
        "Full-shape batches (packing)",
        verdict(statuses),
        over,
        "; ".join(parts) or ok_text,
    )


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
    return Finding("length", "len() vs yielded", verdict(statuses), worst, "; ".join(parts))


def all_findings(rec: Records) -> list[Finding]:
    """Every finding, in report order: the coverage findings of the records' unit (see
    ``_coverage.checks``), then the others (``full_batches`` in place of
    ``partial_batches`` for a packed dataset, ``adjacency`` only when ``rec.shards`` is
    set), with details that repeat over epochs or ranks merged (see ``compact``)."""
    checks: list[Callable[[Records], Finding]] = [
        *coverage_checks(rec),
        rank_balance,
        partial_batches if rec.pack is None else full_batches,
        repeated_order,
        shuffle_quality,
        *([adjacency] if rec.shards is not None else []),
        rng_streams,
        length,
    ]
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
