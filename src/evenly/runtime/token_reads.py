"""Packing's documents read straight from a source's token window: where the source
offers ``token_ranges`` (local Arrow files, see :class:`evenly.sources._tokens.TokenSpan`),
a group's documents are located with one fancy index, checked against their planned
lengths in one comparison, and their pieces' tokens gathered with one more: no Python
per document or per piece.  Anything else reads documents one by one (the packer)."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from evenly.core.packing.pieces import Empty
from evenly.core.packing.settings import Packing
from evenly.runtime.clock import perf_counter
from evenly.runtime.reader import ReadContext

__all__ = ["check_lengths", "direct_tokens"]

I64 = npt.NDArray[np.int64]


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
) -> I64 | None:
    """The tokens of every piece, one after the other (int64; what ``piece_tokens`` gives
    from documents read one by one), read through the source's token window; None where
    the source has none.  ``where``/``index``: each distinct document's epoch position and
    source index; ``planned``: their planned lengths; ``inverse``: each piece's document;
    ``empty``: where the tokens go."""
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
    return tokens
