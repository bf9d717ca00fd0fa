"""Findings for a packed ``evenly.Dataset(pack=...)`` (pure numpy).

A packed row is pieces of documents, so "every sample exactly once" becomes "every token
of every document exactly once per epoch", asked of the pieces each rank delivered
(``Records.pieces``: document, absolute start, token count), never token by token:

- ``tokens``: per epoch, the pieces of each document, sorted, must tile
  ``[0, len(document))`` exactly; a gap is a missing token range, an overlap a repeated
  one, each named by document and rank (replaces ``duplicates`` and ``missing``).
- ``pad_rows``: pad rows per epoch, reported; more than filling the epoch's last global
  batch needs (``world_size x batch_size - 1``) is not minimal: FAIL.
- ``full_batches``: every batch holds ``batch_size`` rows of at most ``seq_len`` tokens
  (replaces ``partial_batches``); equal batch counts per rank stay ``rank_balance``'s.

Over a Mix by tokens (``evenly.Mix(unit="tokens")``) a document is not delivered once
per epoch: a source up-sampled by its weight delivers some documents twice, and an epoch
may start or end inside a document.  What each epoch must deliver is then its plan's
items (document, first token, token count): :func:`compare` counts, per document token,
how many times the plan holds it minus how many times the ranks delivered it, with one
sort over the range ends (never token by token).

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

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from ._types import I64, Finding, Records, Status, batch_sizes

__all__ = [
    "Coverage",
    "compare",
    "coverage",
    "full_batches",
    "merged_pieces",
    "pad_rows",
    "pieces_coverage",
    "record_coverage",
    "tokens",
]

#: Token ranges named per problem.
SHOWN = 3


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


def _pack(rec: Records) -> tuple[I64, I64]:
    if rec.pack is None or rec.pieces is None:
        raise ValueError("these findings need the records of an audit of a packed dataset")
    return rec.pack.lengths, rec.pieces


def record_coverage(rec: Records) -> list[Coverage]:
    """``coverage`` of an audit's records."""
    lengths, pieces = _pack(rec)
    return pieces_coverage(lengths, rec.epochs, rec.epoch, rec.rank, pieces)


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


def _planned(rec: Records) -> list[Coverage]:
    """A Mix by tokens: each epoch's pieces against its plan's (``compare``)."""
    _, pieces = _pack(rec)
    assert rec.pack is not None and rec.pack.expected is not None
    epoch = rec.epoch[pieces[:, 0]]
    out = []
    for e, expected in enumerate(rec.pack.expected):
        sel = epoch == e
        delivered = (pieces[sel, 1], pieces[sel, 2], pieces[sel, 3])
        missing, repeated, text = compare(expected, delivered)
        if missing or repeated:
            out.append(Coverage(e, missing, repeated, text))
    return out


def tokens(rec: Records) -> Finding:
    """Every token of every document exactly once per epoch, across all ranks and
    workers: a missing or repeated token range FAILs, named by document and rank.  A Mix
    by tokens: every planned piece exactly once (its streams' share of the epoch)."""
    lengths, _ = _pack(rec)
    assert rec.pack is not None
    title = "Every token once (packing)"
    if rec.pack.expected is not None:
        found = _planned(rec)
        if not found:
            planned = sum(int(x[2].sum()) for x in rec.pack.expected)
            detail = f"every planned token of the mixture ({planned} over the epochs) once"
            return Finding("tokens", title, "PASS", 0, detail)
    else:
        found = record_coverage(rec)
    if not found:
        detail = (
            f"every token of the {len(lengths)} documents ({int(lengths.sum())} tokens) "
            f"delivered exactly once per epoch"
        )
        return Finding("tokens", title, "PASS", 0, detail)
    worst = max(c.missing + c.repeated for c in found)
    detail = "; ".join(f"epoch {c.epoch}: {c.text}" for c in found)
    return Finding("tokens", title, "FAIL", worst, detail)


def pad_rows(rec: Records) -> Finding:
    """Pad rows per epoch (reported); more than the epoch's last global batch needs (or
    any under ``pad='none'``): FAIL."""
    _, pieces = _pack(rec)
    assert rec.pack is not None
    step = rec.world_size * rec.batch_size
    limit = 0 if rec.pack.pad == "none" else step - 1
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
    if not parts:
        parts.append("no pad rows")
    status: Status = "FAIL" if statuses else "PASS"
    return Finding(
        "pad_rows", "Pad rows (packing)", status, int(counts.max(initial=0)), "; ".join(parts)
    )


def full_batches(rec: Records) -> Finding:
    """Every batch holds ``batch_size`` rows (``pad='none'``: one partial batch per rank
    per epoch is a WARN) and no row more than ``seq_len`` tokens."""
    _, pieces = _pack(rec)
    assert rec.pack is not None
    parts: list[str] = []
    statuses: list[Status] = []
    filled = np.bincount(pieces[:, 0], weights=pieces[:, 3], minlength=len(rec))
    over = int((filled > rec.pack.seq_len).sum())
    if over:
        statuses.append("FAIL")
        parts.append(f"{over} rows hold more than seq_len={rec.pack.seq_len} tokens")
    ranks, epochs, sizes = batch_sizes(rec)
    short = sizes < rec.batch_size
    for e in range(rec.epochs):
        per_rank = np.bincount(ranks[short & (epochs == e)], minlength=rec.world_size)
        if not per_rank.any():
            continue
        ok = rec.pack.pad == "none" and per_rank.max() <= 1
        statuses.append("WARN" if ok else "FAIL")
        parts.append(
            f"epoch {e}: batches with fewer than {rec.batch_size} rows per rank "
            f"{per_rank.tolist()}" + (" (pad='none')" if ok else "")
        )
    status: Status = "FAIL" if "FAIL" in statuses else ("WARN" if statuses else "PASS")
    ok_text = f"every batch {rec.batch_size} rows of at most {rec.pack.seq_len} tokens"
    return Finding(
        "full_batches", "Full-shape batches (packing)", status, over, "; ".join(parts) or ok_text
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
