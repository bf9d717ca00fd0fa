"""A mixture by tokens: one epoch's document order over several sources (numpy only).

Semantics
---------
Source ``d`` is an endless *token stream*: its passes one after the other (pass ``k``: a
keyed permutation of its documents, the identity without shuffle), each document cut
into pieces of at most ``seq_len`` tokens (cuts at multiples of ``seq_len`` from the
document's start).  Epoch ``e`` takes tokens ``[e * T_d, (e + 1) * T_d)`` of that stream,
``T_d`` being source ``d``'s share of ``tokens_per_epoch = T`` by weight (largest
remainder, :func:`token_shares`); a piece that crosses the epoch's edge is split there
and the rest opens the next epoch.  The epoch's *items* (pieces, or parts of pieces at
its edges) of all sources are merged in the order of their virtual midpoints
``(r + len / 2) / T_d``, where ``r`` is the item's first token counted from the
source's epoch start (ties: source, then ``r``).  The order depends on the seed, the
epoch, the weights and ``T`` only: never on ranks, workers or the batch size.

Why it is exact
---------------
Cut the merged order anywhere (any token prefix ``t``; with ``concat`` packing, every
global step boundary is one).  With ``p_d = T_d / T`` and ``t`` between the midpoint
tags, each source holds ``p_d * K + r_d`` tokens, ``|r_d| <= seq_len / 2``, so its
deviation from its share ``p_d * t`` is ``r_d (1 - p_d) - p_d * sum_{k != d} r_k``:

    |tokens_d(t) - p_d * t| <= seq_len / 2 * (1 + p_d * (D - 2))

for ``D`` sources (:func:`deviation_bound`): under half a row for two sources, under one
row (``seq_len``) for three, and for more whenever ``p_d <= 1 / (D - 2)``.

>>> lengths = [np.array([3, 3, 3, 3]), np.array([5, 1])]
>>> shares = token_shares([12, 6], [2, 1], 12)
>>> shares
(8, 4)
>>> items = token_epoch(lengths, shares, seq_len=4, seed=0, epoch=0, shuffle=False,
...                     names=["a", "b"])
>>> [(int(d), int(s), int(n)) for d, s, n in items[["doc", "start", "len"]]][:4]
[(0, 0, 3), (4, 0, 4), (1, 0, 3), (2, 0, 2)]
>>> int(items["len"].sum())
12
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from evenly.core.mix.apportion import mix_counts
from evenly.core.permutation import derive_keys, keyed_bijection, mix64
from evenly.errors import StateError, check_int

__all__ = [
    "ITEM",
    "check_token_state",
    "check_unit",
    "deviation_bound",
    "token_epoch",
    "token_shares",
]

I64 = npt.NDArray[np.int64]
#: One item of the epoch's order: tokens ``[start, start + len)`` of global document
#: ``doc`` (16 bytes, the layout of the node's plan file too).
ITEM = np.dtype([("doc", "<i8"), ("start", "<i4"), ("len", "<i4")])
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def token_shares(
    totals: Sequence[int],
    weights: Sequence[float] | None,
    tokens_per_epoch: int | None,
    *,
    names: Sequence[str] | None = None,
) -> tuple[int, ...]:
    """Tokens per epoch of each source: ``w_d / sum(w) * T`` by largest remainder
    (defaults: weights proportional to each source's tokens, ``T`` their sum)."""
    for d, (n, w) in enumerate(zip(totals, weights or totals, strict=True)):
        if int(n) == 0 and w > 0:
            name = repr(names[d]) if names is not None else f"#{d}"
            raise ValueError(
                f"source {name} has no tokens but weight {w}: give it weight 0 or leave it out"
            )
    return mix_counts(totals, weights, tokens_per_epoch, names=names)


def check_unit(
    unit: str, samples_per_epoch: int | None, min_step: int | None, tokens: int | None
) -> str:
    """``evenly.Mix(unit=...)`` and the arguments that go with it, checked."""
    if unit not in ("samples", "tokens"):
        raise ValueError(f"evenly.Mix(unit=...) must be 'samples' or 'tokens', got {unit!r}")
    if unit == "samples" and tokens is not None:
        raise ValueError("evenly.Mix(tokens_per_epoch=...) needs unit='tokens'")
    if unit == "tokens":
        if tokens is not None:
            check_int("tokens_per_epoch", tokens, minimum=1)
        for name, given in (("samples_per_epoch", samples_per_epoch), ("min_step", min_step)):
            if given is not None:
                raise ValueError(
                    f"evenly.Mix(unit='tokens') takes no {name}: its epoch is "
                    "tokens_per_epoch tokens, exact at every prefix whatever the step"
                )
    return unit


def check_token_state(state: Any, mine: dict[str, Any]) -> None:
    """A token mixture's part of a checkpoint must match the Mix it is loaded into."""
    for key in ("unit", "names", "lengths", "weights", "tokens_per_epoch"):
        if not isinstance(state, dict) or state.get(key) != mine[key]:
            got = state.get(key) if isinstance(state, dict) else state
            raise StateError(
                f"evenly.Mix: the state's {key} is {got!r}, this Mix has {mine[key]!r}: a "
                "token mixture resumes only with the same sources, weights and "
                "tokens_per_epoch"
            )


def deviation_bound(shares: Sequence[int], seq_len: int) -> tuple[float, ...]:
    """Per source, the most its tokens among any prefix of the epoch's order may differ
    from its share of that prefix (see the module)."""
    total = sum(int(s) for s in shares)
    d = len(shares)
    return tuple(seq_len / 2 * (1 + int(s) / total * max(d - 2, 0)) for s in shares)


def _pass_docs(n: int, key: int, k: int, shuffle: bool) -> I64:
    docs = np.arange(n, dtype=np.int64)
    if not shuffle or n < 2:
        return docs
    word = mix64(np.array([key], dtype=np.uint64) ^ mix64(np.array([k], np.uint64) * _GOLDEN))
    keys = np.full(n, word[0], dtype=np.uint64)
    return keyed_bijection(docs, np.full(n, n, dtype=np.int64), keys)


def _source_items(
    lengths: Any, lo: int, hi: int, *, seq_len: int, key: int, shuffle: bool
) -> tuple[I64, I64, I64, I64]:
    """``(doc, start, len, r)`` of the items of tokens ``[lo, hi)`` of one source's
    stream (``r``: the item's first token counted from ``lo``)."""
    lens_all = np.asarray(lengths)
    total = int(lens_all.sum(dtype=np.int64))
    parts: list[tuple[I64, I64, I64, I64]] = []
    for k in range(lo // total, (hi - 1) // total + 1):
        base = k * total
        a, b = max(lo, base) - base, min(hi, base + total) - base
        docs = _pass_docs(lens_all.size, key, k, shuffle)
        lens = lens_all[docs].astype(np.int64)
        ends = np.cumsum(lens)
        starts = ends - lens
        first = int(np.searchsorted(ends, a, side="right"))
        last = int(np.searchsorted(starts, b, side="left"))
        sel = slice(first, last)
        d, st, en = docs[sel], starts[sel], ends[sel]
        keep = en > st  # documents without tokens hold no item
        d, st, en = d[keep], st[keep], en[keep]
        rel_lo, rel_hi = np.maximum(st, a) - st, np.minimum(en, b) - st
        p_lo, p_hi = rel_lo // seq_len, (rel_hi - 1) // seq_len
        count = p_hi - p_lo + 1
        seg = np.repeat(np.arange(d.size), count)
        piece = p_lo[seg] + np.arange(seg.size) - np.repeat(np.cumsum(count) - count, count)
        s = np.maximum(rel_lo[seg], piece * seq_len)
        e = np.minimum(rel_hi[seg], (piece + 1) * seq_len)
        parts.append((d[seg], s, e - s, st[seg] + s + base - lo))
    return tuple(np.concatenate([p[i] for p in parts]) for i in range(4))  # type: ignore[return-value]


def token_epoch(
    lengths: Sequence[Any],
    shares: Sequence[int],
    *,
    seq_len: int,
    seed: int,
    epoch: int,
    shuffle: bool,
    names: Sequence[str],
    offsets: Sequence[int] | None = None,
) -> npt.NDArray[np.void]:
    """Epoch ``epoch``'s items (:data:`ITEM`) in order: ``doc`` is the global index
    (sources concatenated in ``names`` order).  ``offsets``: each stream's token offset at
    the epoch start (default ``epoch * share``: the weights never changed)."""
    total = sum(int(s) for s in shares)
    if offsets is None:
        offsets = [epoch * int(s) for s in shares]
    bases = np.concatenate([[0], np.cumsum([len(x) for x in lengths])[:-1]]).astype(np.int64)
    cols: list[list[I64]] = [[], [], [], [], []]
    tags: list[npt.NDArray[np.float64]] = []
    for d, (lens, share, off) in enumerate(zip(lengths, shares, offsets, strict=True)):
        if int(share) == 0:
            continue
        (key,) = derive_keys(f"mix-tokens/{len(names[d])}:{names[d]}", seed, 0, 1)
        doc, start, n, r = _source_items(
            lens, int(off), int(off) + int(share), seq_len=seq_len, key=key, shuffle=shuffle
        )
        tags.append((2 * r + n).astype(np.float64) * (total / (2.0 * int(share))))
        src = np.full(doc.size, d, dtype=np.int64)
        for col, values in zip(cols, (doc + bases[d], start, n, r, src), strict=True):
            col.append(values)
    doc, start, n, r, src = (np.concatenate(c) for c in cols)
    order = np.lexsort((r, src, np.concatenate(tags)))
    out = np.empty(order.size, dtype=ITEM)
    out["doc"], out["start"], out["len"] = doc[order], start[order], n[order]
    return out
