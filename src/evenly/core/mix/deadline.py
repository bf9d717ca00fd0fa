"""A mixture by tokens where one source dominates: the pieces merged by deadline (numpy
and the standard library only: no torch, no I/O).

The midpoint merge of :mod:`evenly.core.mix.tokens` keeps source ``d`` within
``seq_len / 2 * (1 + p_d * (D - 2))`` tokens of its share, which is over one row where
some ``p_d > 1 / (D - 2)`` (four sources or more): the small sources' pieces may all
fall on the same side of a prefix, and the dominant source pays for all of them.  For
those weights the epoch's pieces are merged one at a time instead.  With ``t`` the
tokens merged so far, ``T`` the epoch's, ``S_d`` source ``d``'s and ``L = seq_len``, the
next piece ``[r, r + n)`` (tokens of its source's epoch) of source ``d``:

* is *released* once it would leave ``d`` at most ``L`` ahead of its share:
  ``(r + n) - S_d / T * (t + n) <= L``;
* has the *deadline* ``floor((r + L) * T / S_d)``: the last ``t`` it may start at and
  leave ``d`` at most ``L`` behind.

The released piece with the earliest deadline goes next (ties: the lower source).

Why it is exact
---------------
Some piece is always released: were every source's next piece held back, each source
would be ahead of its share by more than ``p_d * L > 0``, but the shares of ``t`` add up
to the tokens merged.  No deadline is missed: were piece ``j`` of ``d`` not started by its
deadline ``x``, take the last start ``t0 <= x`` of a piece that ranks after ``j`` (or
``t0 = 0``).  At ``t0`` no piece ranking before ``j`` was released, so each source that
contributes such pieces was more than ``p_e * (t0 + L)`` tokens in, and its pieces up to
deadline ``x`` hold fewer than ``p_e * (x - t0 - L)`` tokens.  Together that is fewer
than ``x - t0 - L``, too few to keep the merge busy from the end of the piece at ``t0``
(at most ``L`` long) to ``x``.  So at every prefix, any token of any piece:

    |tokens_d(t) - S_d / T * t| <= seq_len

All of it is integer arithmetic, so the order is the same on every machine.  The merge
is sequential, one heap step per piece: about twice the midpoint merge's planning CPU
(docs/packing.md states the cost).

>>> from evenly.core.mix.token_stream import TokenStream
>>> streams = [TokenStream(np.array(x), seq_len=4, key=0, shuffle=False)
...            for x in ([4] * 12, [4], [4], [4])]
>>> shares = [48, 4, 4, 4]  # one source holds 80% of the epoch's 60 tokens
>>> (items,) = deadline_chunks(streams, shares, [0, 0, 0, 0], seq_len=4, bases=[0, 12, 13, 14])
>>> src = np.searchsorted([0, 12, 13, 14], items["doc"], side="right") - 1
>>> have = np.zeros((4, items.size + 1))
>>> np.add.at(have, (src, np.arange(1, items.size + 1)), items["len"])
>>> have = np.cumsum(have, axis=1)  # each source's tokens after every piece
>>> bool((abs(have - np.c_[shares] / 60 * have.sum(axis=0)) <= 4).all())
True
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Sequence

import numpy as np
import numpy.typing as npt

from evenly.core.mix.token_stream import ITEM, TokenStream

__all__ = ["deadline_chunks", "floor_mul_div"]

I64 = npt.NDArray[np.int64]
#: Tokens of a source's stream fetched at a time.
FETCH = 1 << 23


def floor_mul_div(a: I64, num: int, den: int) -> I64:
    """``floor(a * num / den)`` exactly, in int64 (``a * num`` may be past its range):
    ``num = q * den + m``, the quotient of ``a * m`` estimated in floating point and
    corrected by its remainder, which is small enough to be exact in wrapping int64.

    >>> a = np.array([-(10**11), 3, 10**11 + 7])  # a * num is about 10^22
    >>> floor_mul_div(a, 10**11 + 3, 10**9 + 7).tolist() == [
    ...     int(x) * (10**11 + 3) // (10**9 + 7) for x in a]
    True
    """
    q, m = divmod(int(num), int(den))
    est = np.floor(a * (m / den)).astype(np.int64)
    rest = a * np.int64(m) - est * np.int64(den)  # wraps, but the true value is tiny
    est += (rest >= den).astype(np.int64) - (rest < 0).astype(np.int64)
    out: I64 = a * np.int64(q) + est
    return out


class _Feed:
    """One source's pieces of the epoch, fetched ``FETCH`` tokens at a time: the merge's
    view (lengths, release and deadline of each piece, as lists) and the pieces not yet
    handed out (``doc``, ``start``, ``len`` arrays)."""

    def __init__(
        self, stream: TokenStream, offset: int, share: int, total: int, seq_len: int
    ) -> None:
        self.stream, self.offset, self.share = stream, int(offset), int(share)
        self.total, self.seq_len = int(total), int(seq_len)
        self.fetched = 0  # tokens of the epoch's share fetched so far
        self.waiting: list[tuple[I64, I64, I64]] = []
        self.lens: list[int] = []
        self.release: list[int] = []
        self.deadline: list[int] = []

    def fetch(self) -> bool:
        """The next window of pieces into the merge's lists; False at the share's end."""
        while self.fetched < self.share:
            lo, hi = self.fetched, min(self.share, self.fetched + FETCH)
            off = self.offset
            doc, start, n, s = self.stream.items(off + lo, off + hi, off, off + self.share)
            keep = s >= off + lo  # a piece that starts before ``lo`` was in the last window
            self.fetched = hi
            if not keep.any():  # no piece starts here (seq_len over FETCH)
                continue
            doc, start, n, r = doc[keep], start[keep], n[keep], s[keep] - off
            self.waiting.append((doc, start, n))
            # ceil(x) = -floor(-x)
            release = -floor_mul_div(self.seq_len - r - n, self.total, self.share) - n
            deadline = floor_mul_div(r + self.seq_len, self.total, self.share)
            self.lens, self.release = n.tolist(), release.tolist()
            self.deadline = deadline.tolist()
            return True
        return False

    def take(self, count: int) -> tuple[I64, I64, I64]:
        """The next ``count`` pieces merged, in their stream order."""
        parts: list[tuple[I64, I64, I64]] = []
        while count:
            doc, start, n = self.waiting[0]
            if doc.size <= count:
                parts.append(self.waiting.pop(0))
                count -= doc.size
            else:
                parts.append((doc[:count], start[:count], n[:count]))
                self.waiting[0] = (doc[count:], start[count:], n[count:])
                count = 0
        if len(parts) == 1:
            return parts[0]
        return tuple(np.concatenate([p[i] for p in parts]) for i in range(3))  # type: ignore[return-value]


def deadline_chunks(
    streams: Sequence[TokenStream],
    shares: Sequence[int],
    offsets: Sequence[int],
    *,
    seq_len: int,
    bases: Sequence[int] | None = None,
    chunk: int = 1 << 17,
) -> Iterator[npt.NDArray[np.void]]:
    """The epoch's items (:data:`~evenly.core.mix.token_stream.ITEM`) merged by
    deadline, ``chunk`` at a time: each stream starts at its ``offsets`` and gives
    ``shares`` tokens; ``doc`` is the stream's document plus its source's ``bases``."""
    total = sum(int(s) for s in shares)
    feeds = {
        d: _Feed(stream, off, share, total, seq_len)
        for d, (stream, share, off) in enumerate(zip(streams, shares, offsets, strict=True))
        if int(share)
    }
    for feed in feeds.values():
        feed.fetch()
    span = len(streams)
    lens: list[list[int]] = [feeds[d].lens if d in feeds else [] for d in range(span)]
    release = [feeds[d].release if d in feeds else [] for d in range(span)]
    deadline = [feeds[d].deadline if d in feeds else [] for d in range(span)]
    ends = [len(x) for x in lens]
    at = [0] * span
    released: list[tuple[int, int]] = []
    held = [(release[d][0], d) for d in sorted(feeds)]
    heapq.heapify(held)
    push, pop, pushpop = heapq.heappush, heapq.heappop, heapq.heappushpop
    t = 0
    nxt: tuple[int, int] | None = None  # the last source's next piece, released
    while t < total:
        steps: list[int] = []
        add = steps.append
        for _ in range(chunk):
            while held and held[0][0] <= t:
                d = pop(held)[1]
                push(released, (deadline[d][at[d]], d))
            # never empty: see the module
            d = pop(released)[1] if nxt is None else pushpop(released, nxt)[1]
            k = at[d]
            t += lens[d][k]
            add(d)
            k += 1
            if k == ends[d]:
                feed = feeds[d]
                if not feed.fetch():
                    nxt = None
                    if t >= total:
                        break
                    continue
                lens[d], release[d], deadline[d] = feed.lens, feed.release, feed.deadline
                ends[d], k = len(feed.lens), 0
            at[d] = k
            if release[d][k] <= t:
                nxt = (deadline[d][k], d)
            else:
                nxt = None
                push(held, (release[d][k], d))
        src = np.array(steps, dtype=np.int64)
        out = np.empty(src.size, dtype=ITEM)
        for d, feed in feeds.items():
            where = np.flatnonzero(src == d)
            if where.size:
                doc, start, n = feed.take(where.size)
                base = 0 if bases is None else int(bases[d])
                out["doc"][where], out["start"][where], out["len"][where] = doc + base, start, n
        yield out
