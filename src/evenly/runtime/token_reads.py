"""Packing's documents read straight from a source's token window, and the checks of
what a read gives.

Where the source offers ``token_ranges`` (local Arrow files, see
:class:`evenly.sources._tokens.TokenSpan`), a group's documents are located with one
fancy index, checked against their planned lengths in one comparison, and their pieces'
tokens gathered with one more: no Python per document or per piece.  Anything else
reads documents one by one (the packer).  Either way, every token id a read gives is
checked once, vectorised (:func:`check_tokens`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from evenly.core.packing.pieces import IGNORE, Empty
from evenly.core.packing.settings import Packing
from evenly.runtime.clock import perf_counter
from evenly.runtime.reader import ReadContext

__all__ = ["check_lengths", "check_tokens", "direct_tokens"]

I64 = npt.NDArray[np.int64]
#: position in the epoch -> the dtype its document's ids were stored in (None: unknown)
StoredDtype = Callable[[int], "np.dtype[Any] | None"]


def check_tokens(
    ctx: ReadContext,
    packing: Packing,
    flat: I64,
    pieces: npt.NDArray[np.void],
    docs: tuple[I64, I64],
    epoch: int,
    stored: StoredDtype,
    base: Any = 0,
) -> None:
    """Raise, naming the first document at fault, if a token id of a read is negative
    (-100 among them: the loss's ignore index), not below ``Packing.vocab_size`` (when
    known), or ``pad_id``.  ``flat``: the read's pieces' tokens, one after the other
    (every token of the epoch is in one piece, so each is checked once); ``docs``: the
    source index of each distinct position, and each piece's; ``stored``: the dtype a
    position's document was stored in (an unsigned id of 2^63 or more reads as negative);
    ``base``: where each piece's document starts in the source's document (a token
    mixture's pieces of documents), for the offset named.

    Vectorised, two passes per read: the maximum of the ids read as unsigned (a negative
    id is then 2^63 or more, so one reduction bounds both ends) and the search for
    ``pad_id`` the check had before."""
    if not flat.size:
        return
    vocab, pad_id = packing.vocab_size, packing.pad_id
    limit = 2**63 if vocab is None else vocab
    unsigned = np.ascontiguousarray(flat).view(np.uint64)
    if int(unsigned.max()) < limit and not bool((flat == pad_id).any()):
        return
    bad = (flat < 0) | (flat == pad_id)
    if vocab is not None:
        bad |= flat >= vocab
    at = int(np.argmax(bad))
    ends = np.cumsum(pieces["len"].astype(np.int64))
    k = int(np.searchsorted(ends, at, side="right"))
    offset = int(pieces["start"][k]) + at - (int(ends[k]) - int(pieces["len"][k]))
    offset += int(np.broadcast_to(base, pieces.shape)[k])
    doc, pos = int(docs[0][docs[1][k]]), int(pieces["pos"][k])
    where = (
        f"document {doc} (position {pos} of epoch {epoch}) of the "
        f"{type(ctx.source).__name__}{ctx.locate(doc)},"
    )
    raise ValueError(_why(where, int(flat[at]), offset, packing, stored(pos)))


def _why(where: str, value: int, offset: int, packing: Packing, stored: Any) -> str:
    """The message for token id ``value`` at token ``offset`` of a document."""
    head = f"evenly: packing: {where}"
    fix = "fix the tokenizer or the pre-tokenized data (or leave the document out)"
    if value == packing.pad_id:
        return (
            f"{head} uses the pad token pad_id={value} (at token {offset}): pads would be "
            f"indistinguishable from its tokens; choose a pad_id no document uses "
            f"(Packing(pad_id=...), e.g. the tokenizer's pad id)"
        )
    if value < 0 and (stored == np.dtype(np.uint64) or value <= -(2**62)):
        how = ", stored as uint64" if stored is not None else ""
        return (
            f"{head} holds the unsigned token id {value + 2**64} (at token {offset}{how}), "
            f"above int64's range (2^63 - 1): rows are int64, where it would read as "
            f"{value}; {fix}"
        )
    if value == IGNORE:
        return (
            f"{head} holds token id -100 (at token {offset}): the loss's ignore index, so "
            f"its label would silently mask the token, and no vocabulary has it; token ids "
            f"are non-negative: {fix}"
        )
    if value < 0:
        return (
            f"{head} holds the negative token id {value} (at token {offset}): token ids "
            f"are non-negative (an embedding has no row for it); {fix}"
        )
    vocab = packing.vocab_size
    whose = " (the tokenizer's)" if getattr(packing.tokenize, "vocab_size", None) == vocab else ""
    return (
        f"{head} holds token id {value} (at token {offset}), not below "
        f"Packing(vocab_size={vocab}){whose}: the model's embedding has no row for it; "
        f"{fix}, or set Packing(vocab_size=...) to the model's vocabulary size"
    )


def check_lengths(
    sizes: I64, planned: I64, documents: list[int] | I64, positions: I64, epoch: int
) -> None:
    """Raise, naming the first document at fault, if a document's token count is not the
    one its lengths pass found."""
    if np.array_equal(sizes, planned):
        return
    bad = int(np.flatnonzero(sizes != planned)[0])
    raise ValueError(
        f"evenly: packing: document {int(documents[bad])} (position {int(positions[bad])} of "
        f"epoch {epoch}) holds {int(sizes[bad])} tokens, but {int(planned[bad])} when "
        f"its lengths were computed: the transform must keep each document's token "
        f"count (or the source changed since; its cached lengths are in cache_dir/lengths)"
    )


def direct_tokens(
    ctx: ReadContext,
    packing: Packing,
    planned: I64,
    epoch: int,
    where: I64,
    index: I64,
    pieces: npt.NDArray[np.void],
    inverse: I64,
    empty: Empty,
) -> tuple[I64, np.dtype[Any]] | None:
    """The tokens of every piece, one after the other (int64; what ``piece_tokens`` gives
    from documents read one by one), read through the source's token window, and the
    dtype they are stored in; None where the source has none.  ``where``/``index``: each
    distinct document's epoch position and source index; ``planned``: their planned
    lengths; ``inverse``: each piece's document; ``empty``: where the tokens go."""
    ranges = ctx.view.token_ranges
    if ranges is None or packing.tokenize is not None or ctx.transform is not None:
        return None
    started = perf_counter()
    try:
        found = ranges(index, packing.field)
    except Exception as exc:
        first = index[:8].tolist()
        ctx.note(exc, f"documents {first}{'...' if index.size > 8 else ''}")
        raise
    if found is None:
        return None
    span, starts, lengths = found
    check_lengths(lengths, planned, index, where, epoch)
    lengths = pieces["len"].astype(np.int64)
    out = empty("flat", int(lengths.sum()))
    tokens: I64 = span.gather(starts[inverse] + pieces["start"], lengths, out)
    ctx.clock.read += perf_counter() - started
    return tokens, span.values.dtype
