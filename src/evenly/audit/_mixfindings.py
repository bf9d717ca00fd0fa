"""Findings for an ``evenly.Dataset`` over an ``evenly.Mix`` (pure numpy).

A Mix repeats samples by design: a source smaller than its share is read in whole passes,
so "every sample exactly once per epoch" is the wrong question.  The right ones, asked
here of the index each delivered sample was read from (``Records.reads``):

- ``mix_counts``: did each source contribute exactly ``mix.counts[name]`` samples in each
  epoch?  Padding (fewer than ``world_size`` repeats in all) is allowed; so is what
  ``drop_last`` leaves out (WARN).
- ``duplicates`` / ``missing``, per source stream: each source is an endless stream of
  its own passes, each pass a permutation of the source, so after ``T`` items read from
  a pass boundary every sample of the source was read ``T // n`` or ``T // n + 1`` times
  (once before twice).  Judged after every epoch over all epochs so far.

>>> import numpy as np
>>> from evenly.audit._types import MixInfo, Records
>>> mix = MixInfo(("a", "b"), (3, 1), (3, 2), ((0, 0),))
>>> reads = np.array([0, 1, 2, 3, 3])           # b (index 3) has one sample: read twice
>>> n = len(reads)
>>> zeros = np.zeros(n, dtype=np.int64)
>>> rec = Records(ids=reads, rank=zeros, worker=zeros, epoch=zeros, batch=zeros,
...               pos=np.arange(n), draws=np.zeros((n, 3)), per_rank=[], world_size=1,
...               num_workers=0, epochs=1, batch_size=n, mix=mix, reads=reads)
>>> mix_counts(rec).status, mix_counts(rec).detail
('PASS', "every epoch: 'a' 3, 'b' 2 (as mix.counts)")
>>> stream_duplicates(rec).detail
'every sample of each source read once per pass before any twice'
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from evenly.core.mix.apportion import mix_counts as apportion

from ._types import I64, Finding, MixInfo, Records, Status

__all__ = [
    "cell_status",
    "delivered",
    "epoch_counts",
    "mix_counts",
    "per_epoch",
    "source_counts",
    "stream_duplicates",
    "stream_missing",
]


def cell_status(row: dict[str, Any], name: str) -> str:
    """A per-epoch table cell's verdict: PASS (exact), WARN (off within the epoch's
    padding / drop_last slack, as the ``mix_counts`` finding allows) or FAIL."""
    off = abs(int(row["delivered"][name]) - int(row["expected"][name]))
    return "PASS" if off == 0 else "WARN" if off <= int(row.get("slack", 0)) else "FAIL"


def _mix(rec: Records) -> tuple[MixInfo, I64]:
    if rec.mix is None or rec.reads is None:
        raise ValueError("these findings need the records of an audit of an evenly.Mix")
    return rec.mix, rec.reads


def _valid(mix: MixInfo, reads: I64) -> Any:
    return (reads >= 0) & (reads < int(sum(mix.lengths)))


def delivered(rec: Records) -> I64:
    """Samples delivered per epoch and source, shape ``(epochs, sources)`` (samples whose
    read index is unknown are not counted)."""
    mix, reads = _mix(rec)
    return source_counts(mix, reads, rec.epoch, rec.epochs)


def source_counts(mix: MixInfo, reads: I64, epoch: I64, epochs: int) -> I64:
    """Samples per epoch and source, shape ``(epochs, sources)``, of the samples read from
    ``reads`` (indices into the Mix) in ``epoch``; unknown reads and epochs from
    ``epochs`` on are not counted."""
    out = np.zeros((epochs, len(mix.names)), dtype=np.int64)
    ok = _valid(mix, reads) & (epoch < epochs)
    np.add.at(out, (epoch[ok], mix.source_of(reads[ok])), 1)
    return out


def _global_position(rec: Records) -> I64:
    """Each sample's position in its epoch's global order (steps of ``world_size x
    batch_size``, rank by rank), as ``evenly.DataLoader`` deals them."""
    step = rec.world_size * rec.batch_size
    out: I64 = rec.batch * step + rec.rank * rec.batch_size + rec.pos
    return out


def epoch_counts(rec: Records) -> I64:
    """The samples each source owes each epoch under the weights in force, shape
    ``(epochs, sources)``: ``mix.counts`` until the audit changed the weights
    (``set_weights=``).  An epoch changed at global positions ``P_1 < ... < P_k`` owes,
    after ``P_k``, exactly the Mix's apportionment of the rest (``c'_d`` of ``R = S -
    P_k`` positions, by largest remainder); between two changes each source's count is
    its share of that segment's apportionment within ``mix.bounds`` (a count beyond them
    is owed its rounded share, so ``mix_counts`` names it); later epochs follow the last
    weights."""
    mix, reads = _mix(rec)
    base = np.asarray(mix.counts, dtype=np.int64)
    out = np.tile(base, (rec.epochs, 1))
    if not mix.changes:
        return out
    total = int(base.sum())
    tol = np.maximum(np.asarray(mix.bounds or (1.0,) * len(base), dtype=np.float64), 1.0)
    ok = _valid(mix, reads)
    src = np.full(len(reads), -1, dtype=np.int64)
    src[ok] = mix.source_of(reads[ok])
    position = _global_position(rec)
    current = base
    for e in range(rec.epochs):
        changes = [(p, w) for ce, p, w in mix.changes if ce == e and 0 < p < total]
        if not changes:
            out[e] = current
            continue
        owed = np.zeros(len(base), dtype=np.int64)
        start, counts, rest = 0, current, total
        for p, weights in changes:
            inside = (rec.epoch == e) & (position >= start) & (position < p) & (src >= 0)
            got = np.bincount(src[inside], minlength=len(base))[: len(base)]
            share = (p - start) * counts / rest
            owed += np.where(np.abs(got - share) <= tol, got, np.rint(share).astype(np.int64))
            start, rest = p, total - p
            counts = np.asarray(apportion(mix.lengths, weights, rest), dtype=np.int64)
        out[e] = owed + counts
        current = np.asarray(apportion(mix.lengths, changes[-1][1], total), dtype=np.int64)
    return out


def _slack(rec: Records, mix: MixInfo) -> tuple[I64, I64]:
    """Per epoch: positions repeated as padding, and positions left out (``drop_last``),
    from the samples delivered against ``sum(mix.counts)``."""
    total = np.bincount(rec.epoch, minlength=rec.epochs)[: rec.epochs].astype(np.int64)
    extra = total - int(sum(mix.counts))
    pads: I64 = np.maximum(extra, 0)
    drops: I64 = np.maximum(-extra, 0)
    return pads, drops


def _named(mix: MixInfo, values: Any, *, skip_zero: bool = False) -> str:
    return ", ".join(
        f"{name!r} {int(v)}"
        for name, v in zip(mix.names, values, strict=True)
        if v or not skip_zero
    )


def mix_counts(rec: Records) -> Finding:
    """Samples per source per epoch against ``mix.counts``: exact, or off only by padding
    (fewer than ``world_size`` repeats in all: PASS) or by what ``drop_last`` left out
    (fewer than ``world_size * batch_size``: WARN); anything else FAILs, naming the
    source."""
    mix, reads = _mix(rec)
    got = delivered(rec)
    owed = epoch_counts(rec)
    pads, drops = _slack(rec, mix)
    unknown = np.bincount(rec.epoch[~_valid(mix, reads)], minlength=rec.epochs)
    parts: list[str] = []
    statuses: list[Status] = []
    notes: list[str] = []
    for e in range(rec.epochs):
        want = owed[e]
        diff = got[e] - want
        if unknown[e]:
            statuses.append("FAIL")
            parts.append(
                f"epoch {e}: {int(unknown[e])} samples with no recorded read of the Mix "
                f"(a source path the audit cannot trace)"
            )
        if not diff.any():
            continue
        if (diff >= 0).all() and int(diff.sum()) == pads[e] < rec.world_size:
            notes.append(f"epoch {e}: +{int(pads[e])} padding repeat(s)")
            continue
        if (diff <= 0).all() and -int(diff.sum()) == drops[e] < rec.world_size * rec.batch_size:
            statuses.append("WARN")
            parts.append(f"epoch {e}: drop_last left out {_named(mix, -diff, skip_zero=True)}")
            continue
        statuses.append("FAIL")
        wrong = [
            f"{name!r} {int(g)} (expected {int(w)}, {int(g - w):+d})"
            for name, g, w in zip(mix.names, got[e], want, strict=True)
            if g != w
        ]
        parts.append(f"epoch {e}: " + ", ".join(wrong))
    worst = int(np.abs(got - owed).max()) if got.size else 0
    if not parts and mix.changes:
        moved = sorted({ce for ce, _, _ in mix.changes})
        parts.append(
            f"every epoch as the weights in force (changed in epoch(s) {moved}): "
            + "; ".join(f"epoch {e}: {_named(mix, owed[e])}" for e in range(rec.epochs))
        )
    elif not parts:
        parts.append(f"every epoch: {_named(mix, owed[0])} (as mix.counts)")
    status: Status = "FAIL" if "FAIL" in statuses else ("WARN" if statuses else "PASS")
    return Finding(
        "mix_counts", "Samples per source (Mix)", status, worst, "; ".join(parts + notes)
    )


def _window(n: int, start: int, items: int) -> tuple[int, int]:
    """(fewest, most) times each sample of a source of ``n`` samples is read in stream
    items ``[start, start + items)``: passes wholly inside, passes touched."""
    if items <= 0:
        return 0, 0
    end = start + items
    inside = max(0, end // n - -(-start // n))
    touched = -(-end // n) - start // n
    return inside, touched


class _Gap(NamedTuple):
    """One source's reads over epochs ``0..epoch``, against what its stream allows."""

    epoch: int
    source: str
    over: int  # reads beyond ``most`` per sample, summed
    under: int  # reads short of ``fewest`` per sample, summed
    most: int
    fewest: int


def _stream_gaps(rec: Records) -> list[_Gap]:
    """Per epoch (counting all epochs up to it) and source: how far the reads of each
    sample are outside what a stream of whole passes allows."""
    mix, reads = _mix(rec)
    ok = _valid(mix, reads)
    bases = np.concatenate([[0], np.cumsum(mix.lengths)[:-1]]).astype(np.int64)
    src = np.full(len(reads), -1, dtype=np.int64)
    src[ok] = mix.source_of(reads[ok])
    start = mix.offsets[0] if mix.offsets else (0,) * len(mix.names)
    read = np.cumsum(epoch_counts(rec), axis=0)  # items each stream read by each epoch's end
    out = []
    for d, (name, n) in enumerate(zip(mix.names, mix.lengths, strict=True)):
        counts = np.zeros(n, dtype=np.int64)
        for e in range(rec.epochs):
            rows = (src == d) & (rec.epoch == e)
            counts += np.bincount(reads[rows] - bases[d], minlength=n)[:n]
            fewest, most = _window(n, int(start[d]), int(read[e, d]))
            over = int(np.maximum(counts - most, 0).sum())
            under = int(np.maximum(fewest - counts, 0).sum())
            out.append(_Gap(e, name, over, under, most, fewest))
    return out


def _judge(
    rec: Records, name: str, title: str, field: str, allowed: tuple[I64, str], what: str, ok: str
) -> Finding:
    """A finding from ``_Gap.<field>`` per epoch: 0 PASS, within the cumulative
    ``allowed`` (padding or drop_last) WARN, beyond FAIL."""
    gaps = _stream_gaps(rec)
    budget = np.cumsum(allowed[0])
    parts: list[str] = []
    statuses: list[Status] = []
    worst = 0
    for e in range(rec.epochs):
        rows = [g for g in gaps if g.epoch == e and getattr(g, field) > 0]
        total = sum(int(getattr(g, field)) for g in rows)
        worst = max(worst, total)
        if not rows:
            continue
        status: Status = "WARN" if total <= budget[e] else "FAIL"
        statuses.append(status)
        parts.append(
            f"epoch {e}: "
            + ", ".join(
                what.format(source=g.source, k=getattr(g, field), most=g.most, fewest=g.fewest)
                for g in rows
            )
            + (f" (within {allowed[1]})" if status == "WARN" else "")
        )
    status_all: Status = "FAIL" if "FAIL" in statuses else ("WARN" if statuses else "PASS")
    return Finding(name, title, status_all, worst, "; ".join(parts) or ok)


def stream_duplicates(rec: Records) -> Finding:
    """Samples of a source read more often than its stream allows by the end of each epoch
    (a sample read twice before every sample of the source was read once): FAIL; no more
    than the padding repeats: WARN."""
    mix, _ = _mix(rec)
    pads, _drops = _slack(rec, mix)
    return _judge(
        rec,
        "duplicates",
        "Duplicates (per source stream)",
        "over",
        (pads, "padding"),
        "{source!r}: {k} extra reads (at most {most}x each by now)",
        "every sample of each source read once per pass before any twice",
    )


def stream_missing(rec: Records) -> Finding:
    """Samples of a source read less often than its stream requires by the end of each
    epoch (left out of a pass the stream completed): FAIL; no more than ``drop_last``
    left out: WARN."""
    mix, _ = _mix(rec)
    _pads, drops = _slack(rec, mix)
    return _judge(
        rec,
        "missing",
        "Missing (per source stream)",
        "under",
        (drops, "what drop_last left out"),
        "{source!r}: {k} reads short (at least {fewest}x each by now)",
        "every sample of each source read in every pass its stream completed",
    )


def per_epoch(rec: Records) -> list[dict[str, Any]]:
    """Per epoch: each source's samples delivered, expected and stream offset (for the
    JSON, the table and the HTML report)."""
    mix, _ = _mix(rec)
    got = delivered(rec)
    owed = epoch_counts(rec)
    pads, drops = _slack(rec, mix)
    first = np.asarray(mix.offsets[0] if mix.offsets else (0,) * len(mix.names))
    offsets = first + np.cumsum(owed, axis=0) - owed  # each stream's offset at epoch start
    return [
        {
            "epoch": e,
            "delivered": dict(zip(mix.names, got[e].tolist(), strict=True)),
            "expected": dict(zip(mix.names, owed[e].tolist(), strict=True)),
            # padding repeats / left-out positions that epoch: a source may be off by that
            "slack": int(pads[e] + drops[e]),
            "stream_offsets": dict(zip(mix.names, offsets[e].tolist(), strict=True)),
            "weight_changes": [
                {"position": p, "weights": dict(zip(mix.names, w, strict=True))}
                for ce, p, w in mix.changes
                if ce == e
            ],
        }
        for e in range(rec.epochs)
    ]
