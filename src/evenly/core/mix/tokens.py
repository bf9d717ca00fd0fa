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

for ``D`` sources with a share: under half a row for two sources, under one row
(``seq_len``) for three, and for more whenever ``p_d <= 1 / (D - 2)``.  Where some
source's ``p_d > 1 / (D - 2)`` (:func:`merge_of`), the pieces are merged by deadline
instead (:mod:`evenly.core.mix.deadline`), which keeps every source within ``seq_len``:
every source is within one row of its share at every prefix, whatever the weights
(:func:`deviation_bound`).

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

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from evenly.core.mix.apportion import mix_counts
from evenly.core.mix.deadline import deadline_chunks
from evenly.core.mix.token_stream import ITEM, TokenStream
from evenly.core.permutation import derive_keys
from evenly.errors import StateError, check_int
from evenly.options import UNITS, Unit

__all__ = [
    "ITEM",
    "TokenSegment",
    "check_token_state",
    "check_unit",
    "deviation_bound",
    "merge_of",
    "offsets_at",
    "segmented_chunks",
    "token_epoch",
    "token_epoch_chunks",
    "token_segments",
    "token_shares",
]

I64 = npt.NDArray[np.int64]
#: Items per window of the merge (about).
CHUNK = 1 << 17


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
    unit: Unit, samples_per_epoch: int | None, min_step: int | None, tokens: int | None
) -> Unit:
    """``evenly.Mix(unit=...)`` and the arguments that go with it, checked."""
    if unit not in UNITS:
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


def check_token_state(state: Any, mine: dict[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """A token mixture's part of a checkpoint must match the Mix it is loaded into;
    returns what the pass carries from it (the streams' anchor and weight changes)."""
    if isinstance(state, dict) and "merge" not in state:  # saved before the deadline merge
        part = state.get("part") or {}
        try:
            vectors = [state.get("weights"), part.get("weights")]
            vectors += [c[1] for c in part.get("changes", ())]
            dominated = any(_may_dominate(w, len(names)) for w in vectors)
        except (AttributeError, TypeError, IndexError, ValueError):
            dominated = False  # malformed: named by the checks below
        if dominated:
            raise StateError(
                "evenly.Mix: this state was saved by an evenly that merged every token "
                "mixture by midpoint; one where a source dominates four or more is now "
                "merged by deadline (docs/packing.md), so its position would name other "
                "tokens: resume it with the evenly that saved it, or start the epoch over"
            )
        state = {**state, "merge": mine["merge"]}
    for key in ("unit", "names", "lengths", "weights", "tokens_per_epoch", "merge"):
        if not isinstance(state, dict) or state.get(key) != mine[key]:
            got = state.get(key) if isinstance(state, dict) else state
            raise StateError(
                f"evenly.Mix: the state's {key} is {got!r}, this Mix has {mine[key]!r}: a "
                "token mixture resumes only with the same sources, weights and "
                "tokens_per_epoch (set_weights changes are in the state's part)"
            )
    part = state.get("part")
    if part is None:
        return {}
    try:
        check_int("anchor_epoch", part["anchor_epoch"], minimum=0)
        vectors = [part["anchor_offsets"]] + [c[2] for c in part["changes"]]
        weights = [w for w in [part["weights"]] + [c[1] for c in part["changes"]] if w]
        positions = [check_int("change position", c[0], minimum=1) for c in part["changes"]]
        ok = all(len(v) == len(names) and all(int(x) >= 0 for x in v) for v in vectors)
        ok = ok and all(len(w) == len(names) and min(w) >= 0 < sum(w) for w in weights)
        ok = ok and positions == sorted(set(positions))
    except (KeyError, TypeError, IndexError, ValueError) as exc:
        raise StateError(f"evenly.Mix: the state's token-mixture part is malformed: {exc}") from exc
    if not ok:
        raise StateError(f"evenly.Mix: the state's token-mixture part is malformed: {part!r}")
    return dict(part)


def _may_dominate(weights: Any, sources: int) -> bool:
    """Whether a token mixture saved with these weights (``None``: by tokens) may be
    merged by deadline (the shares, not known here, round the weights)."""
    if weights is None:
        return sources >= 4
    held = [float(w) for w in weights if float(w) > 0]
    return len(held) >= 4 and max(held) * (len(held) - 2) >= sum(held) * (1 - 1e-9)


def merge_of(shares: Sequence[int]) -> str:
    """How an epoch with these shares is merged: ``"midpoint"``, or ``"deadline"`` where
    the midpoint bound would pass one row (some ``p_d * (D - 2) > 1``, ``D`` the sources
    with a share)."""
    held = [int(s) for s in shares if int(s)]
    if len(held) >= 4 and max(held) * (len(held) - 2) > sum(held):
        return "deadline"
    return "midpoint"


def deviation_bound(shares: Sequence[int], seq_len: int) -> tuple[float, ...]:
    """Per source, the most its tokens among any prefix of the epoch's order may differ
    from its share of that prefix (see the module): at most ``seq_len``."""
    if merge_of(shares) == "deadline":
        return tuple(float(seq_len) for _ in shares)
    total = sum(int(s) for s in shares)
    d = sum(1 for s in shares if int(s))
    return tuple(seq_len / 2 * (1 + int(s) / total * max(d - 2, 0)) for s in shares)


def token_epoch(
    lengths: Sequence[Any], shares: Sequence[int], **kwargs: Any
) -> npt.NDArray[np.void]:
    """Epoch ``epoch``'s items (:data:`ITEM`) in order, in one array (the keywords of
    :func:`token_epoch_chunks`)."""
    return np.concatenate([np.empty(0, dtype=ITEM), *token_epoch_chunks(lengths, shares, **kwargs)])


def token_epoch_chunks(
    lengths: Sequence[Any],
    shares: Sequence[int],
    *,
    seq_len: int,
    seed: int,
    epoch: int,
    shuffle: bool,
    names: Sequence[str],
    offsets: Sequence[int] | None = None,
    chunk: int = CHUNK,
) -> Iterator[npt.NDArray[np.void]]:
    """Epoch ``epoch``'s items (:data:`ITEM`) in order, about ``chunk`` at a time (memory:
    a few times that, whatever the epoch's size).  ``doc`` is the global index (sources
    concatenated in ``names`` order); ``offsets``: each stream's token offset at the epoch
    start (default ``epoch * share``: the weights never changed).

    The midpoint merge runs over windows of virtual time: an item belongs to the window
    of its midpoint tag, and each source's items of a window lie in a token range of the
    window's width (plus one piece), so windows are sorted one by one.  Where
    :func:`merge_of` says ``"deadline"``, :func:`~evenly.core.mix.deadline.deadline_chunks`
    merges them."""
    total = sum(int(x) for x in shares)
    if offsets is None:
        offsets = [epoch * int(x) for x in shares]
    bases = np.concatenate([[0], np.cumsum([len(x) for x in lengths])[:-1]]).astype(np.int64)
    streams = []
    for d, lens in enumerate(lengths):
        (key,) = derive_keys(f"mix-tokens/{len(names[d])}:{names[d]}", seed, 0, 1)
        streams.append(TokenStream(lens, seq_len=seq_len, key=key, shuffle=shuffle))
    if merge_of(shares) == "deadline":
        yield from deadline_chunks(
            streams, shares, offsets, seq_len=seq_len, bases=bases.tolist(), chunk=chunk
        )
        return
    pieces = sum(
        int(x) * st.pieces / st.total for x, st in zip(shares, streams, strict=True) if int(x)
    )
    windows = max(1, -(-int(pieces + len(shares)) // chunk))
    for j in range(windows):
        lo_t, hi_t = total * j / windows, (total * (j + 1) / windows if j + 1 < windows else np.inf)
        cols: list[list[I64]] = [[], [], [], [], []]
        tags: list[npt.NDArray[np.float64]] = []
        for d, (stream, share, off) in enumerate(zip(streams, shares, offsets, strict=True)):
            share, off = int(share), int(off)
            if share == 0:
                continue
            p = share / total
            lo = max(0, int(lo_t * p) - seq_len - 1)
            hi = share if hi_t == np.inf else min(share, int(hi_t * p) + 2)
            doc, start, n, s = stream.items(off + lo, off + hi, off, off + share)
            tag = (2 * (s - off) + n).astype(np.float64) * (total / (2.0 * share))
            keep = (tag >= lo_t) & (tag < hi_t)
            tags.append(tag[keep])
            src = np.full(int(keep.sum()), d, dtype=np.int64)
            for col, values in zip(cols, (doc + bases[d], start, n, s, src), strict=True):
                col.append(values[keep] if values is not src else values)
        doc, start, n, s, src = (np.concatenate(c) for c in cols)
        order = np.lexsort((s, src, np.concatenate(tags)))
        out = np.empty(order.size, dtype=ITEM)
        out["doc"], out["start"], out["len"] = doc[order], start[order], n[order]
        yield out


@dataclass(frozen=True)
class TokenSegment:
    """A stretch of an epoch under one set of weights: from token ``start`` of the epoch,
    each stream continues from ``offsets`` and takes ``shares`` tokens (the rest of the
    epoch, by ``weights``), until the next segment starts."""

    start: int
    offsets: tuple[int, ...]
    shares: tuple[int, ...]
    weights: tuple[float, ...] | None


def token_segments(
    part: Mapping[str, Any] | None,
    epoch: int,
    totals: Sequence[int],
    weights: Sequence[float] | None,
    tokens: int,
) -> list[TokenSegment]:
    """Epoch ``epoch``'s segments.  ``part`` is what a pass carries after a loaded state
    or ``set_weights`` (``anchor_epoch``, ``anchor_offsets``: the streams at its start,
    ``weights`` in force from it, ``changes``: ``[token position, weights, offsets
    there]`` inside it); without one, epoch ``e`` starts at ``e`` times the shares."""

    def shares(w: Sequence[float] | None, rest: int) -> tuple[int, ...]:
        return token_shares(totals, w, rest)

    own = shares(weights, tokens)
    w_own = None if weights is None else tuple(float(x) for x in weights)
    if not part or epoch < int(part["anchor_epoch"]):
        return [TokenSegment(0, tuple(epoch * s for s in own), own, w_own)]
    e0 = int(part["anchor_epoch"])
    w0 = w_own if part.get("weights") is None else tuple(float(x) for x in part["weights"])
    offsets = tuple(int(x) for x in part["anchor_offsets"])
    segments = [TokenSegment(0, offsets, shares(w0, tokens), w0)]
    for pos, w, offs in part.get("changes", ()):
        weights_at = tuple(float(x) for x in w)
        at = tuple(int(x) for x in offs)
        segments.append(
            TokenSegment(int(pos), at, shares(weights_at, tokens - int(pos)), weights_at)
        )
    if epoch == e0:
        return segments
    last = segments[-1]
    full = shares(last.weights, tokens)
    start = [
        o + s + (epoch - e0 - 1) * f
        for o, s, f in zip(last.offsets, last.shares, full, strict=True)
    ]
    return [TokenSegment(0, tuple(start), full, last.weights)]


def _segment_chunks(
    lengths: Sequence[Any], segment: TokenSegment, budget: int, **kwargs: Any
) -> Iterator[npt.NDArray[np.void]]:
    """The first ``budget`` tokens of a segment's items (the last item cut there)."""
    for chunk in token_epoch_chunks(
        lengths, segment.shares, offsets=segment.offsets, epoch=0, **kwargs
    ):
        if budget <= 0:
            return
        cum = np.cumsum(chunk["len"], dtype=np.int64)
        if cum.size and int(cum[-1]) >= budget:
            k = int(np.searchsorted(cum, budget, side="left"))
            out = chunk[: k + 1].copy()
            out["len"][-1] -= int(cum[k]) - budget
            yield out
            return
        budget -= int(cum[-1]) if cum.size else 0
        yield chunk


def segmented_chunks(
    lengths: Sequence[Any], segments: Sequence[TokenSegment], tokens: int, **kwargs: Any
) -> Iterator[npt.NDArray[np.void]]:
    """An epoch's items, segment after segment (each cut where the next starts)."""
    ends = [s.start for s in segments[1:]] + [tokens]
    for segment, end in zip(segments, ends, strict=True):
        yield from _segment_chunks(lengths, segment, end - segment.start, **kwargs)


def offsets_at(
    lengths: Sequence[Any], segment: TokenSegment, position: int, **kwargs: Any
) -> tuple[int, ...]:
    """Each stream's offset after the epoch's first ``position`` tokens (inside
    ``segment``): what a weight change there continues from."""
    bases = np.concatenate([[0], np.cumsum([len(x) for x in lengths])]).astype(np.int64)
    used = np.zeros(len(lengths), dtype=np.int64)
    for chunk in _segment_chunks(lengths, segment, position - segment.start, **kwargs):
        src = np.searchsorted(bases, chunk["doc"], side="right") - 1
        np.add.at(used, src, chunk["len"].astype(np.int64))
    return tuple(int(o + u) for o, u in zip(segment.offsets, used.tolist(), strict=True))
