"""Findings about order: shuffle quality, same-shard neighbours, repeated epochs.

Pure numpy.  A uniform shuffle of ``M`` deliveries has position-vs-id rank correlation
near 0 (|rho| under ``4 / sqrt(M - 1)``), mean displacement near ``(M^2 - 1) / 3M``
(reported as a fraction: 1.0 is random, 0.0 is sorted), and same-shard in-batch
neighbours at the rate ``sum n_g (n_g - 1) / (M (M - 1))``.

>>> spearman([1, 2, 3, 4], [10, 20, 30, 40]), spearman([1, 2, 3], [3, 2, 1])
(1.0, -1.0)
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from ._types import F64, I64, Finding, Records, Status, epochs_of

__all__ = ["adjacency", "repeated_order", "shuffle_quality", "spearman"]

#: Mean displacement below this fraction of a random permutation's counts as unshuffled.
MIN_DISPLACEMENT = 0.5
#: Same-shard neighbours above this multiple of the uniform ideal count as clustered.
MAX_ADJACENCY = 1.5


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


def _pct(x: float) -> str:
    return f"{x:.0%}" if x >= 0.1 or x == 0 else f"{x:.2%}"


def _epoch_order(rec: Records, e: int) -> I64:
    """Ids of epoch ``e`` in the order a DDP step sees them."""
    order = rec.global_order()
    ids: I64 = rec.ids[order][rec.epoch[order] == e]
    return ids


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
    return max(0.05, 4.0 / float(np.sqrt(max(m - 1, 1))))


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
    for e in epochs_of(rec):
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
        "Shuffle (position vs id)",
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
    for e in epochs_of(rec):
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
            f"epoch {e}: {_pct(observed)} of in-batch neighbours share a shard, "
            f"ideal {_pct(ideal)} ({ratio:.1f}x)"
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
        for e in epochs_of(rec):
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
            "Repeated order",
            "PASS",
            0,
            "one epoch: nothing to compare",
        )
    if not repeats:
        return Finding(
            "repeated_order",
            "Repeated order",
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
        "Repeated order",
        "FAIL" if shuffled else "WARN",
        len(repeats),
        detail,
    )
