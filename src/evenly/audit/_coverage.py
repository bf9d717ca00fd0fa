"""Coverage: every unit exactly once per epoch, one checker for the three units (numpy).

One core (``judge``): per epoch, the units delivered beyond what the epoch owes (repeats)
or short of it (missing), named in the unit's words; an amount within the epoch's
allowance (the padding that equalises ranks, what ``drop_last`` leaves out) is a WARN,
beyond it a FAIL.  What a unit is, what an epoch owes and how a gap is named:

- **samples** (``duplicates``, ``missing``): every sample once, across all ranks and
  workers, against ``Records.expected`` (unknown: the union of ids over all epochs).
- **a Mix's shares** (``Records.mix``): a Mix repeats samples by design (a source
  smaller than its share is read in whole passes), so it is asked of the index each
  sample was read from (``Records.reads``): did each source contribute
  ``mix.counts[name]`` samples in each epoch (``mix_counts``), and is each source's
  stream read in whole passes, each a permutation of the source: after ``T`` items from
  a pass boundary every sample read ``T // n`` or ``T // n + 1`` times
  (``stream_duplicates`` / ``stream_missing``, judged over all epochs so far).
- **tokens** (``Records.pack``): every token of every document once, asked of the pieces
  each rank delivered (``Records.pieces``: document, absolute start, token count), never
  token by token (``tokens``; ``coverage`` names a gap or an overlap by document and
  rank).  Over a Mix by tokens a document is not delivered once per epoch: each epoch
  owes its plan's pieces, and ``compare`` counts per document token how often the plan
  holds it minus how often the ranks delivered it, with one sort over the range ends.
  ``pad_rows``: more pad rows than filling the last global batch needs is not minimal.

``checks`` gives a unit's findings, in report order.

>>> ids = np.array([0, 1, 0, 1])
>>> zeros = np.zeros(4, dtype=np.int64)
>>> rec = Records(ids=ids, rank=zeros, worker=np.array([0, 0, 1, 1]), epoch=zeros,
...               batch=np.array([0, 0, 1, 1]), pos=np.array([0, 1, 0, 1]),
...               draws=np.random.default_rng(0).random((4, 3)), per_rank=[],
...               world_size=1, num_workers=2, epochs=1, batch_size=2, expected=2)
>>> duplicates(rec).detail
'epoch 0: 2 extra deliveries, every sample delivered 2x'

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

>>> expected = (np.array([0, 0, 1]), np.array([0, 0, 0]), np.array([4, 4, 2]))  # doc 0 twice
>>> delivered = (np.array([0, 0, 1]), np.array([0, 0, 1]), np.array([4, 2, 1]))
>>> compare(expected, delivered)
(3, 0, 'document 0 tokens [2, 4) missing 1x, document 1 tokens [0, 1) missing 1x')
>>> lengths = np.array([4, 3])
>>> cols = dict(epoch=np.zeros(3, dtype=np.int64), rank=np.array([0, 1, 1]),
...             doc=np.array([0, 0, 1]), start=np.array([0, 2, 0]),
...             length=np.array([3, 2, 2]))
>>> for part in coverage(lengths=lengths, epochs=1, **cols)[0].text.split("; "):
...     print(part)
1 token repeated (document 0 tokens [2, 3) by rank 1, first by rank 0)
1 token missing (document 1 tokens [2, 3), its other pieces from rank 1)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from evenly.core.mix.apportion import mix_counts as apportion

from ._types import I64, Finding, MixInfo, PackInfo, Records, Status, epochs_of

__all__ = [
    "Coverage",
    "Gap",
    "cell_status",
    "checks",
    "compare",
    "coverage",
    "delivered",
    "duplicates",
    "epoch_counts",
    "judge",
    "merged_pieces",
    "missing",
    "mix_counts",
    "pad_rows",
    "per_epoch",
    "pieces_coverage",
    "source_counts",
    "stream_duplicates",
    "stream_missing",
    "tokens",
    "verdict",
]

#: Sample ids named per finding part.
SHOWN_IDS = 5

#: Token ranges named per problem.
SHOWN = 3


# ---- the core ------------------------------------------------------------------------


def verdict(statuses: Sequence[Status]) -> Status:
    """The worst of ``statuses``: FAIL, else WARN, else PASS."""
    return "FAIL" if "FAIL" in statuses else "WARN" if "WARN" in statuses else "PASS"


class Gap(NamedTuple):
    """One epoch's units delivered beyond (or short of) what it owes, named."""

    epoch: int
    amount: int
    text: str


def judge(
    name: str,
    title: str,
    gaps: Sequence[Gap],
    *,
    ok: str,
    allowed: Sequence[int] | I64 | None = None,
    within: str = "",
    note: str = "",
) -> Finding:
    """A coverage finding from the epochs with a gap: none is a PASS (``ok`` says so); a
    gap within its epoch's ``allowed`` amount a WARN (its part followed by ``within``,
    the finding by ``note``); beyond it (or with nothing allowed) a FAIL.  The value is
    the largest gap."""
    statuses: list[Status] = []
    parts = []
    for g in gaps:
        warn = allowed is not None and g.amount <= allowed[g.epoch]
        statuses.append("WARN" if warn else "FAIL")
        parts.append(f"epoch {g.epoch}: {g.text}" + (within if warn else ""))
    status = verdict(statuses)
    if status == "WARN" and note:
        parts.append(note)
    worst = max((g.amount for g in gaps), default=0)
    return Finding(name, title, status, worst, "; ".join(parts) or ok)


def checks(rec: Records) -> tuple[Callable[[Records], Finding], ...]:
    """The coverage findings of ``rec``'s unit, in report order: samples, a Mix's shares
    (``rec.mix``) or tokens (``rec.pack``)."""
    if rec.mix is not None:
        return stream_duplicates, stream_missing, mix_counts
    if rec.pack is not None:
        return tokens, pad_rows
    return duplicates, missing


# ---- samples -------------------------------------------------------------------------


def duplicates(rec: Records) -> Finding:
    """Samples delivered more than once in an epoch, across all ranks and workers.

    A few duplicates (fewer than ``world_size``) are what padding to equal ranks costs
    (``DistributedSampler``, ``evenly.Dataset(drop_last=False)``): WARN. More: FAIL.
    """
    gaps = []
    for e in epochs_of(rec):
        ids = rec.ids[rec.epoch == e]
        _, counts = np.unique(ids, return_counts=True)
        extra = int(len(ids) - len(counts))
        if extra == 0:
            continue
        if counts.min() == counts.max():
            how = f"every sample delivered {int(counts[0])}x"
        else:
            how = (
                f"{int((counts > 1).sum())} samples delivered more than once "
                f"(up to {int(counts.max())}x)"
            )
        gaps.append(Gap(e, extra, f"{extra} extra deliveries, {how}"))
    return judge(
        "duplicates",
        "Duplicates",
        gaps,
        ok="every sample delivered at most once per epoch",
        allowed=[rec.world_size - 1] * rec.epochs,
        note="(fewer than world_size: padding so every rank gets the same count)",
    )


def missing(rec: Records) -> Finding:
    """Samples never delivered in an epoch, against ``rec.expected`` (or, unknown, the
    union of ids over all epochs)."""
    reference = rec.expected
    source = rec.expected_source
    if reference is None:
        reference = len(np.unique(rec.ids))
        source = "ids seen over all epochs"
    gaps = []
    for e in epochs_of(rec):
        seen = len(np.unique(rec.ids[rec.epoch == e]))
        if seen < reference:
            dropped = _dropped(rec.dropped.get(e, []))
            text = f"{reference - seen} of {reference} never delivered ({seen} seen{dropped})"
            gaps.append(Gap(e, reference - seen, text))
        elif seen > reference:
            text = f"{seen} distinct samples, more than the {reference} expected"
            gaps.append(Gap(e, seen - reference, text))
    ok = f"all {reference} samples delivered every epoch"
    return judge("missing", f"Missing (vs {source})", gaps, ok=ok)


def _dropped(names: list[str]) -> str:
    """The samples read but left out of the collated batches, named."""
    if not names:
        return ""
    shown = ", ".join(names[:SHOWN_IDS]) + (", ..." if len(names) > SHOWN_IDS else "")
    return f", {len(names)} read but not in the batches collate_fn returned: {shown}"


# ---- a Mix's shares ------------------------------------------------------------------


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


def _sources(mix: MixInfo, reads: I64) -> I64:
    """The source number of each read, -1 where the read is unknown."""
    ok = _valid(mix, reads)
    src = np.full(len(reads), -1, dtype=np.int64)
    src[ok] = mix.source_of(reads[ok])
    return src


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
    src = _sources(mix, reads)
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
    return Finding(
        "mix_counts", "Samples per source (Mix)", verdict(statuses), worst, "; ".join(parts + notes)
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


def _stream_gaps(rec: Records, *, repeats: bool, what: str) -> list[Gap]:
    """Per epoch (counting all epochs up to it): each source's reads beyond the most its
    stream of whole passes allows (``repeats``) or short of the fewest, summed over its
    samples; ``what`` names a source's part (``{source}``, ``{k}``, ``{most}``,
    ``{fewest}``)."""
    mix, reads = _mix(rec)
    bases = np.concatenate([[0], np.cumsum(mix.lengths)[:-1]]).astype(np.int64)
    src = _sources(mix, reads)
    start = mix.offsets[0] if mix.offsets else (0,) * len(mix.names)
    read = np.cumsum(epoch_counts(rec), axis=0)  # items each stream read by each epoch's end
    counts = [np.zeros(n, dtype=np.int64) for n in mix.lengths]
    gaps = []
    for e in range(rec.epochs):
        parts, total = [], 0
        for d, (name, n) in enumerate(zip(mix.names, mix.lengths, strict=True)):
            rows = (src == d) & (rec.epoch == e)
            counts[d] += np.bincount(reads[rows] - bases[d], minlength=n)[:n]
            fewest, most = _window(n, int(start[d]), int(read[e, d]))
            off = counts[d] - most if repeats else fewest - counts[d]
            k = int(np.maximum(off, 0).sum())
            if k:
                total += k
                parts.append(what.format(source=name, k=k, most=most, fewest=fewest))
        if total:
            gaps.append(Gap(e, total, ", ".join(parts)))
    return gaps


def stream_duplicates(rec: Records) -> Finding:
    """Samples of a source read more often than its stream allows by the end of each epoch
    (a sample read twice before every sample of the source was read once): FAIL; no more
    than the padding repeats: WARN."""
    mix, _ = _mix(rec)
    pads, _drops = _slack(rec, mix)
    return judge(
        "duplicates",
        "Duplicates (per source stream)",
        _stream_gaps(
            rec, repeats=True, what="{source!r}: {k} extra reads (at most {most}x each by now)"
        ),
        ok="every sample of each source read once per pass before any twice",
        allowed=np.cumsum(pads),
        within=" (within padding)",
    )


def stream_missing(rec: Records) -> Finding:
    """Samples of a source read less often than its stream requires by the end of each
    epoch (left out of a pass the stream completed): FAIL; no more than ``drop_last``
    left out: WARN."""
    mix, _ = _mix(rec)
    _pads, drops = _slack(rec, mix)
    return judge(
        "missing",
        "Missing (per source stream)",
        _stream_gaps(
            rec, repeats=False, what="{source!r}: {k} reads short (at least {fewest}x each by now)"
        ),
        ok="every sample of each source read in every pass its stream completed",
        allowed=np.cumsum(drops),
        within=" (within what drop_last left out)",
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


# ---- tokens --------------------------------------------------------------------------


class Coverage(NamedTuple):
    """One epoch's token accounting: tokens missing, repeated, and what to say."""

    epoch: int
    missing: int
    repeated: int
    text: str


def _ranges(doc: I64, a: I64, b: I64, note: list[str]) -> str:
    shown = [
        f"document {int(d)} tokens [{int(x)}, {int(y)}){n}"
        for d, x, y, n in zip(doc[:SHOWN], a[:SHOWN], b[:SHOWN], note[:SHOWN], strict=True)
    ]
    return ", ".join(shown) + (", ..." if len(doc) > SHOWN else "")


def _repeats(doc: I64, a: I64, b: I64, again: I64, first: I64) -> str:
    """The first repeated ranges, one range per run of pieces that continue each other in
    a document (a resumed epoch repeats whole rows: their pieces follow on)."""
    starts = np.flatnonzero(np.r_[True, (doc[1:] != doc[:-1]) | (a[1:] != b[:-1])])
    ends = np.r_[starts[1:], len(doc)]
    shown = []
    for lo, hi in zip(starts[:SHOWN].tolist(), ends[:SHOWN].tolist(), strict=True):
        by = "/".join(str(r) for r in sorted({int(r) for r in again[lo:hi]}))
        was = "/".join(str(r) for r in sorted({int(r) for r in first[lo:hi]}))
        shown.append(
            f"document {int(doc[lo])} tokens [{int(a[lo])}, {int(b[hi - 1])}) by rank {by}, "
            f"first by rank {was}"
        )
    return ", ".join(shown) + (", ..." if len(starts) > SHOWN else "")


def _plural(n: int) -> str:
    return f"{n} token{'s' if n != 1 else ''}"


def _epoch(lengths: I64, rank: I64, doc: I64, start: I64, length: I64) -> tuple[int, int, str]:
    """Missing and repeated tokens of one epoch's pieces, and the ranges named."""
    order = np.lexsort((-length, start, doc))
    doc, start, length, rank = doc[order], start[order], length[order], rank[order]
    end = start + length
    n_docs = len(lengths)
    parts: list[str] = []
    unknown = (doc < 0) | (doc >= n_docs)
    if unknown.any():
        parts.append(f"{int(unknown.sum())} pieces of documents that do not exist")
        keep = ~unknown
        doc, start, length, rank, end = doc[keep], start[keep], length[keep], rank[keep], end[keep]
    big = int(max(int(end.max()) if len(end) else 0, int(lengths.max()) if n_docs else 0)) + 1
    key = doc * big + end
    running = np.maximum.accumulate(key) if len(key) else key
    index = np.arange(len(key))
    holder = np.maximum.accumulate(np.where(key >= running, index, 0)) if len(key) else index
    first = np.r_[True, doc[1:] != doc[:-1]] if len(doc) else np.zeros(0, dtype=bool)
    prev_end = np.where(first, 0, np.r_[0, running[:-1]] - doc * big)
    prev_rank = rank[np.r_[0, holder[:-1]]] if len(doc) else rank
    # repeated: a piece starting before the furthest token delivered so far
    over = start < prev_end
    rep_a, rep_b = start[over], np.minimum(end[over], prev_end[over])
    repeated = int((rep_b - rep_a).sum())
    # missing: a gap before a piece, a document's tail, a document never delivered
    gap = start > prev_end
    last = np.r_[doc[1:] != doc[:-1], True] if len(doc) else np.zeros(0, dtype=bool)
    furthest = running[last] - doc[last] * big
    tail = furthest < lengths[doc[last]]
    absent = np.setdiff1d(np.flatnonzero(lengths > 0), doc)
    miss_doc = np.concatenate([doc[gap], doc[last][tail], absent])
    miss_a = np.concatenate([prev_end[gap], furthest[tail], np.zeros(len(absent), np.int64)])
    miss_b = np.concatenate([start[gap], lengths[doc[last]][tail], lengths[absent]])
    beyond = end > lengths[doc]
    past = int((end[beyond] - np.maximum(start[beyond], lengths[doc[beyond]])).sum())
    if repeated:
        named = _repeats(doc[over], rep_a, rep_b, rank[over], prev_rank[over])
        parts.append(f"{_plural(repeated)} repeated ({named})")
    missing = int((miss_b - miss_a).sum())
    if missing:
        order = np.lexsort((miss_a, miss_doc))
        miss_doc, miss_a, miss_b = miss_doc[order], miss_a[order], miss_b[order]
        others = {int(d): sorted({int(r) for r in rank[doc == d]}) for d in miss_doc[:SHOWN]}
        notes = [
            f", its other pieces from rank {'/'.join(map(str, others[int(d)]))}"
            if others.get(int(d))
            else " (no piece of it delivered)"
            for d in miss_doc[:SHOWN]
        ]
        parts.append(f"{_plural(missing)} missing ({_ranges(miss_doc, miss_a, miss_b, notes)})")
    if past:
        parts.append(f"{_plural(past)} past the end of their documents")
    return missing, repeated + past + int(unknown.sum()), "; ".join(parts)


def coverage(
    *, lengths: I64, epochs: int, epoch: I64, rank: I64, doc: I64, start: I64, length: I64
) -> list[Coverage]:
    """Per epoch with a problem: the token accounting of its pieces (one entry per piece
    in the columns: its epoch, the rank that delivered it, document, start, tokens)."""
    out = []
    lengths = np.asarray(lengths, dtype=np.int64)
    for e in range(epochs):
        sel = epoch == e
        missing, repeated, text = _epoch(lengths, rank[sel], doc[sel], start[sel], length[sel])
        if missing or repeated:
            out.append(Coverage(e, missing, repeated, text))
    return out


def pieces_coverage(
    lengths: I64, epochs: int, epoch: I64, rank: I64, pieces: I64
) -> list[Coverage]:
    """``coverage`` of packed ``pieces`` (row, document, start, tokens), with each row's
    ``epoch`` and ``rank``."""
    row = pieces[:, 0]
    return coverage(
        lengths=lengths,
        epochs=epochs,
        epoch=epoch[row],
        rank=rank[row],
        doc=pieces[:, 1],
        start=pieces[:, 2],
        length=pieces[:, 3],
    )


Ranges = tuple[I64, I64, I64]


def compare(expected: Ranges, delivered: Ranges) -> tuple[int, int, str]:
    """``(missing, repeated, text)``: tokens the plan holds more often than the ranks
    delivered them, tokens delivered more often than planned, and the first ranges."""
    (ed, es, el), (dd, ds, dl) = expected, delivered
    docs = np.concatenate([ed, ed, dd, dd]).astype(np.int64)
    pos = np.concatenate([es, es + el, ds, ds + dl]).astype(np.int64)
    ones = np.ones(len(ed), dtype=np.int64), np.ones(len(dd), dtype=np.int64)
    delta = np.concatenate([ones[0], -ones[0], -ones[1], ones[1]])
    order = np.lexsort((pos, docs))
    docs, pos, level = docs[order], pos[order], np.cumsum(delta[order])
    if docs.size < 2:
        return 0, 0, ""
    same = docs[1:] == docs[:-1]
    width = np.where(same, pos[1:] - pos[:-1], 0)
    value = level[:-1]
    bad = (width > 0) & (value != 0)
    missing = int((width * np.maximum(value, 0)).sum())
    repeated = int((width * np.maximum(-value, 0)).sum())
    shown = [
        f"document {int(d)} tokens [{int(a)}, {int(a + w)}) "
        f"{'missing' if v > 0 else 'repeated'} {abs(int(v))}x"
        for d, a, w, v in zip(
            docs[:-1][bad][:SHOWN],
            pos[:-1][bad][:SHOWN],
            width[bad][:SHOWN],
            value[bad][:SHOWN],
            strict=True,
        )
    ]
    more = ", ..." if int(bad.sum()) > SHOWN else ""
    return missing, repeated, ", ".join(shown) + more


def _pack(rec: Records) -> tuple[PackInfo, I64]:
    if rec.pack is None or rec.pieces is None:
        raise ValueError("these findings need the records of an audit of a packed dataset")
    return rec.pack, rec.pieces


def tokens(rec: Records) -> Finding:
    """Every token of every document exactly once per epoch, across all ranks and
    workers: a missing or repeated token range FAILs, named by document and rank.  A Mix
    by tokens: every planned piece exactly once (its streams' share of the epoch)."""
    pack, pieces = _pack(rec)
    if pack.expected is None:
        found = pieces_coverage(pack.lengths, rec.epochs, rec.epoch, rec.rank, pieces)
        ok = (
            f"every token of the {len(pack.lengths)} documents ({pack.tokens} tokens) "
            f"delivered exactly once per epoch"
        )
    else:
        epoch = rec.epoch[pieces[:, 0]]
        found = []
        for e, expected in enumerate(pack.expected):
            sel = epoch == e
            missing, repeated, text = compare(
                expected, (pieces[sel, 1], pieces[sel, 2], pieces[sel, 3])
            )
            if missing or repeated:
                found.append(Coverage(e, missing, repeated, text))
        planned = sum(int(x[2].sum()) for x in pack.expected)
        ok = f"every planned token of the mixture ({planned} over the epochs) once"
    gaps = [Gap(c.epoch, c.missing + c.repeated, c.text) for c in found]
    return judge("tokens", "Every token once (packing)", gaps, ok=ok)


def pad_rows(rec: Records) -> Finding:
    """Pad rows per epoch (reported); more than the epoch's last global batch needs (or
    any under ``pad='none'``): FAIL."""
    pack, pieces = _pack(rec)
    limit = 0 if pack.pad == "none" else rec.world_size * rec.batch_size - 1
    pad = rec.ids < 0
    with_pieces = int(pad[pieces[:, 0]].sum())
    parts: list[str] = []
    statuses: list[Status] = []
    counts = np.bincount(rec.epoch[pad], minlength=rec.epochs)[: rec.epochs]
    for e, n in enumerate(counts.tolist()):
        if n > limit:
            statuses.append("FAIL")
            parts.append(f"epoch {e}: {n} pad rows, more than the {limit} minimal padding allows")
        elif n:
            parts.append(f"epoch {e}: {n} pad rows (the last global batch filled)")
    if with_pieces:
        statuses.append("FAIL")
        parts.append(f"{with_pieces} pieces of documents in pad rows")
    return Finding(
        "pad_rows",
        "Pad rows (packing)",
        verdict(statuses),
        int(counts.max(initial=0)),
        "; ".join(parts) or "no pad rows",
    )


def merged_pieces(results: Sequence[Any]) -> I64:
    """The packed pieces (``.pieces``) of several ``RankResult``, their rows numbered
    across all of them (``.ids`` in order)."""
    parts, at = [], 0
    for r in results:
        if r.pieces is not None:
            part = r.pieces.copy()
            part[:, 0] += at
            parts.append(part)
        at += len(r.ids)
    return np.concatenate(parts) if parts else np.zeros((0, 4), dtype=np.int64)
