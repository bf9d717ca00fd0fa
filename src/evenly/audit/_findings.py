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

from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from ._types import F64, GENERATORS, I64, Finding, Records, Status

__all__ = [
    "adjacency",
    "all_findings",
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
#: Mean displacement below this fraction of a random permutation's counts as unshuffled.
MIN_DISPLACEMENT = 0.5
#: Same-shard neighbours above this multiple of the uniform ideal count as clustered.
MAX_ADJACENCY = 1.5


def _worst(statuses: list[Status]) -> Status:
    for status in ("FAIL", "WARN"):
        if status in statuses:
            return status  # type: ignore[return-value]
    return "PASS"


def _epochs(rec: Records) -> list[int]:
    return list(range(rec.epochs))


def duplicates(rec: Records) -> Finding:
    """Samples delivered more than once in an epoch, across all ranks and workers.

    A few duplicates (fewer than ``world_size``) are what padding to equal ranks costs
    (``DistributedSampler``, ``evenly.Dataset(drop_last=False)``): WARN. More: FAIL.
    """
    parts: list[str] = []
    worst = 0
    for e in _epochs(rec):
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
            "Duplicates per epoch",
            "PASS",
            0,
            "every sample delivered at most once per epoch",
        )
    status: Status = "WARN" if worst < rec.world_size else "FAIL"
    if status == "WARN":
        parts.append("(fewer than world_size: padding so every rank gets the same count)")
    return Finding("duplicates", "Duplicates per epoch", status, worst, "; ".join(parts))


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
    for e in _epochs(rec):
        seen = len(np.unique(rec.ids[rec.epoch == e]))
        gap = reference - seen
        if gap > 0:
            parts.append(f"epoch {e}: {gap} of {reference} never delivered ({seen} seen)")
            statuses.append("FAIL")
        elif gap < 0:
            parts.append(f"epoch {e}: {seen} distinct samples, more than the {reference} expected")
            statuses.append("FAIL")
        worst = max(worst, abs(gap))
    if not parts:
        parts.append(f"all {reference} samples delivered every epoch")
    return Finding(
        "missing", f"Missing per epoch (vs {source})", _worst(statuses), worst, "; ".join(parts)
    )


def rank_balance(rec: Records) -> Finding:
    """Samples and batches per rank per epoch: unequal batch counts hang DDP (FAIL),
    unequal sample counts with equal batches weigh ranks unequally (WARN)."""
    parts: list[str] = []
    statuses: list[Status] = []
    worst = 0
    for e in _epochs(rec):
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
    return Finding(
        "rank_balance", "Per-rank samples and batches", _worst(statuses), worst, "; ".join(parts)
    )


def _batch_sizes(rec: Records) -> tuple[I64, I64, I64]:
    """(rank, epoch, size) of every batch with at least one sample."""
    if len(rec) == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    key = np.stack([rec.epoch, rec.rank, rec.batch], axis=1)
    uniq, sizes = np.unique(key, axis=0, return_counts=True)
    return uniq[:, 1].astype(np.int64), uniq[:, 0].astype(np.int64), sizes.astype(np.int64)


def partial_batches(rec: Records) -> Finding:
    """Batches smaller than ``batch_size``: a map-style loader gives at most one per rank
    per epoch; more means each worker batches its own leftovers (WARN)."""
    ranks, epochs, sizes = _batch_sizes(rec)
    partial = sizes < rec.batch_size
    worst = 0
    parts: list[str] = []
    for e in _epochs(rec):
        per_rank = [
            int((partial & (ranks == r) & (epochs == e)).sum()) for r in range(rec.world_size)
        ]
        worst = max(worst, *per_rank)
        if max(per_rank) > 1:
            parts.append(f"epoch {e}: partial batches per rank {per_rank}")
    status: Status = "WARN" if worst > 1 else "PASS"
    if not parts:
        parts.append(f"at most {worst} partial batch per rank per epoch")
    return Finding("partial_batches", "Partial batches per rank", status, worst, "; ".join(parts))


def spearman(x: npt.ArrayLike, y: npt.ArrayLike) -> float:
    """Spearman rank correlation (average ranks for ties); 0.0 when undefined.

    >>> spearman([1, 2, 3, 4], [10, 20, 30, 40]), spearman([1, 2, 3], [3, 2, 1])
    (1.0, -1.0)
    """
    rx, ry = _ranks(np.asarray(x)), _ranks(np.asarray(y))
    if len(rx) < 2 or rx.std() == 0 or ry.std() == 0:
        return 0.0
    return float(np.corrcoef(rx, ry)[0, 1])


def _ranks(values: npt.NDArray[np.generic]) -> F64:
    _, inverse, counts = np.unique(values, return_inverse=True, return_counts=True)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    average = starts + (counts - 1) / 2.0
    return np.asarray(average[inverse.reshape(-1)], dtype=np.float64)


def _epoch_order(rec: Records, e: int) -> I64:
    """Ids of epoch ``e`` in the order a DDP step sees them."""
    order = rec.global_order()
    return rec.ids[order][rec.epoch[order] == e]


def _displacement(ids: I64) -> float:
    """Mean |position - sorted position| over that of a uniform random permutation."""
    m = len(ids)
    if m < 2:
        return 1.0
    target = _ranks(ids)
    observed = float(np.abs(np.arange(m) - target).mean())
    return observed / ((m * m - 1) / (3.0 * m))


def _rho_limit(m: int) -> float:
    """|rho| a random order exceeds with negligible probability (4 sigma)."""
    return max(0.05, 4.0 / np.sqrt(max(m - 1, 1)))


def _is_shuffled(ids: I64) -> bool:
    return abs(spearman(np.arange(len(ids)), ids)) <= _rho_limit(len(ids)) and (
        _displacement(ids) >= MIN_DISPLACEMENT
    )


def shuffle_quality(rec: Records) -> Finding:
    """Rank correlation of position vs id and mean displacement per epoch (global order).

    A uniform shuffle has |rho| near 0 and displacement near 1 (N/3 on average); an
    unshuffled or locally shuffled stream does not: WARN (fine for evaluation data).
    """
    parts: list[str] = []
    worst_rho = 0.0
    flagged = False
    for e in _epochs(rec):
        ids = _epoch_order(rec, e)
        if len(ids) < 2:
            continue
        rho = spearman(np.arange(len(ids)), ids)
        disp = _displacement(ids)
        worst_rho = max(worst_rho, abs(rho))
        bad = abs(rho) > _rho_limit(len(ids)) or disp < MIN_DISPLACEMENT
        flagged = flagged or bad
        parts.append(
            f"epoch {e}: rho={rho:+.2f}, displacement {disp:.2f} of random"
            + (" (not uniformly shuffled)" if bad else "")
        )
    status: Status = "WARN" if flagged else "PASS"
    return Finding(
        "shuffle",
        "Shuffle quality (position vs id)",
        status,
        round(worst_rho, 4),
        "; ".join(parts) or "no samples",
    )


def adjacency(rec: Records) -> Finding:
    """Neighbours in a batch from the same shard/group, vs a uniform shuffle's ideal
    ``sum n_g (n_g - 1) / (M (M - 1))``.  Needs ``rec.shards`` (from ``shard_fn``)."""
    if rec.shards is None:
        return Finding("adjacency", "Same-shard neighbours", "PASS", 0, "no shard_fn given")
    order = rec.global_order()
    parts: list[str] = []
    worst = 0.0
    flagged = False
    for e in _epochs(rec):
        rows = order[rec.epoch[order] == e]
        m = len(rows)
        if m < 2:
            continue
        shards, batch, rank = rec.shards[rows], rec.batch[rows], rec.rank[rows]
        pair = (batch[1:] == batch[:-1]) & (rank[1:] == rank[:-1])
        n_pairs = int(pair.sum())
        if n_pairs == 0:
            continue
        observed = float((shards[1:] == shards[:-1])[pair].mean())
        _, counts = np.unique(shards, return_counts=True)
        ideal = float((counts * (counts - 1)).sum()) / (m * (m - 1))
        ratio = observed / ideal if ideal > 0 else (np.inf if observed > 0 else 1.0)
        noise = 4.0 * np.sqrt(max(ideal * (1 - ideal), 1e-12) / n_pairs)
        bad = observed > ideal + noise and ratio > MAX_ADJACENCY
        flagged = flagged or bad
        worst = max(worst, ratio)
        parts.append(
            f"epoch {e}: {observed:.0%} of in-batch neighbours share a shard, "
            f"ideal {ideal:.0%} ({ratio:.1f}x)"
        )
    status: Status = "WARN" if flagged else "PASS"
    return Finding(
        "adjacency",
        "Same-shard neighbours",
        status,
        round(worst, 3),
        "; ".join(parts) or "no batch has two samples",
    )


def repeated_order(rec: Records) -> Finding:
    """A rank delivering the same id sequence as in the previous epoch: FAIL when that
    sequence is shuffled (a seed that never changes), WARN when it is not shuffled."""
    repeats: list[tuple[int, int, bool]] = []
    for r in range(rec.world_size):
        previous: I64 | None = None
        for e in _epochs(rec):
            mask = (rec.rank == r) & (rec.epoch == e)
            rows = np.flatnonzero(mask)
            rows = rows[np.lexsort((rec.pos[rows], rec.batch[rows]))]
            seq = rec.ids[rows]
            if previous is not None and len(seq) > 1 and np.array_equal(seq, previous):
                repeats.append((r, e, _is_shuffled(_epoch_order(rec, e))))
            previous = seq
    if rec.epochs < 2:
        return Finding(
            "repeated_order",
            "Order differs from previous epoch",
            "PASS",
            0,
            "one epoch: nothing to compare",
        )
    if not repeats:
        return Finding(
            "repeated_order",
            "Order differs from previous epoch",
            "PASS",
            0,
            "every rank's order changes every epoch",
        )
    shuffled = any(s for _, _, s in repeats)
    where = ", ".join(f"rank {r} epoch {e}" for r, e, _ in repeats[:6])
    detail = (
        f"same shuffled order as the previous epoch: {where} (the seed never changes)"
        if shuffled
        else f"same unshuffled order every epoch: {where}"
    )
    return Finding(
        "repeated_order",
        "Order differs from previous epoch",
        "FAIL" if shuffled else "WARN",
        len(repeats),
        detail,
    )


def rng_streams(rec: Records) -> Finding:
    """Workers or ranks whose random draws after each sample are the same sequence: they
    apply the same "random" augmentations (FAIL).  Equal across epochs only: WARN."""
    key = np.stack([rec.rank, rec.epoch, rec.worker], axis=1)
    if len(key) == 0:
        return Finding("rng_streams", "Random streams distinct", "PASS", 0, "no samples")
    streams, inverse = np.unique(key, axis=0, return_inverse=True)
    inverse = inverse.reshape(-1)
    lengths = np.bincount(inverse, minlength=len(streams))
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
            "Random streams distinct",
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
        "Random streams distinct",
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
    return Finding("length", "len() vs yielded", _worst(statuses), worst, "; ".join(parts[:6]))


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


def all_findings(rec: Records) -> list[Finding]:
    """Every finding, in report order (adjacency only when ``rec.shards`` is set)."""
    return [f(rec) for f in _ALL if f is not adjacency or rec.shards is not None]
