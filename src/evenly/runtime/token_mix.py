"""Packing over an ``evenly.Mix(unit="tokens")``: its documents' lengths and its epochs'
document orders, planned once per node and memory-mapped by every process.

- Lengths: each source's own (:func:`~evenly.runtime.lengths.document_lengths`: cached
  per source, memory-mapped), read by global index through :class:`MixLengths`.
- Epoch ``e``'s order (:func:`~evenly.core.mix.tokens.token_epoch`): one 16-byte item
  per piece, in ``cache_dir/packing/<key>-e<epoch>.items`` (written once by whichever
  process of the node comes first), a window of about half a million items at a time;
  every process then maps the file.
- :class:`TokenMixRows`: the reader strategy of a packed token mixture: its units are
  rows, packed from the epoch's pieces of documents, each piece cut from the whole
  document read for it.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import numpy as np
import numpy.typing as npt

from evenly.core.mix.apportion import check_weights
from evenly.core.mix.tokens import (
    ITEM,
    TokenSegment,
    merge_of,
    offsets_at,
    segmented_chunks,
    token_segments,
)
from evenly.core.packing.pieces import Empty, RowTable, piece_tokens
from evenly.core.packing.settings import Packing
from evenly.core.plan import Order
from evenly.core.source import SourceView
from evenly.core.state import PassState
from evenly.runtime.lengths import document_lengths
from evenly.runtime.packed_plans import PlanFiles, prune
from evenly.runtime.packer import PackedRows, StoredDtype, documents, stored_dtype
from evenly.runtime.reader import ReadContext
from evenly.runtime.seeds import SeedSpreader
from evenly.runtime.strategy import Plans
from evenly.sources._cachedir import cache_subdir, publish

__all__ = [
    "TOKEN_MIX_READ",
    "MixLengths",
    "TokenItems",
    "TokenMixRows",
    "is_token_mix",
    "mix_lengths",
    "token_items",
    "token_reweighted",
]

I64 = npt.NDArray[np.int64]


#: Why a token mixture cannot be read as samples, or with a transform.
TOKEN_MIX_READ = (
    "an evenly.Mix(unit='tokens') is read packed, with no per-document transform"
    " (its documents are cut into seq_len pieces, each placed on its own): pass "
    "pack=evenly.Packing(seq_len, ...) and no transform"
)


def is_token_mix(source: Any) -> bool:
    """Whether ``source`` is an ``evenly.Mix(unit="tokens")``."""
    return getattr(source, "unit", None) == "tokens" and hasattr(source, "token_shares")


class MixLengths:
    """The sources' document lengths read by global index (no concatenated copy)."""

    def __init__(self, parts: Sequence[Any]) -> None:
        self.parts = list(parts)
        self.ends = np.cumsum([len(p) for p in self.parts]).astype(np.int64)
        self.totals = [int(np.sum(p, dtype=np.int64)) for p in self.parts]

    def __len__(self) -> int:
        return int(self.ends[-1]) if self.ends.size else 0

    def __getitem__(self, index: Any) -> npt.NDArray[np.int32]:
        idx = np.asarray(index, dtype=np.int64)
        flat = idx.reshape(-1)
        src = np.searchsorted(self.ends, flat, side="right")
        out = np.empty(flat.size, dtype=np.int32)
        for d in np.unique(src).tolist():
            sel = src == d
            out[sel] = self.parts[d][flat[sel] - (self.ends[d] - len(self.parts[d]))]
        return out.reshape(idx.shape)

    def __reduce__(self) -> tuple[Any, ...]:
        """A worker maps the node's length files again (no copy in the pickle)."""
        return (MixLengths, ([_reopen(p) for p in self.parts],))


def _reopen(part: Any) -> Any:
    if isinstance(part, np.memmap) and part.filename is not None:
        return _Mapped(str(part.filename), len(part))
    return np.asarray(part)


class _Mapped:
    """A length file to map again after unpickling."""

    def __init__(self, path: str, n: int) -> None:
        self.path, self.n = path, n

    def __reduce__(self) -> tuple[Any, ...]:
        return (_open_lengths, (self.path, self.n))


def _open_lengths(path: str, n: int) -> Any:
    return np.memmap(path, dtype=np.int32, mode="r", shape=(n,))


def mix_lengths(mix: Any, packing: Packing) -> tuple[MixLengths, str]:
    """``(lengths, key)`` of a token mixture's documents (each source's cached lengths)."""
    parts, keys = [], []
    for view in mix.views:
        lengths, key = document_lengths(view, packing, view.cache_dir)
        parts.append(lengths)
        keys.append(key)
    return MixLengths(parts), hashlib.blake2b("/".join(keys).encode(), digest_size=16).hexdigest()


class TokenItems:
    """One epoch's items: position -> document (``__call__``, as a document order),
    its piece's first token (``starts``) and token count (``lengths_at``)."""

    def __init__(self, items: npt.NDArray[np.void], key: str) -> None:
        self.items = items
        self.key = key
        self.size = int(items.size)

    def __call__(self, positions: Any) -> I64:
        return np.asarray(self.items["doc"][np.asarray(positions, dtype=np.int64)], np.int64)

    def lengths_at(self, positions: I64) -> I64:
        return np.asarray(self.items["len"][positions], dtype=np.int64)

    def starts(self, positions: I64) -> I64:
        return np.asarray(self.items["start"][positions], dtype=np.int64)

    def cut(
        self, positions: I64, tokens: dict[int, npt.NDArray[np.integer]]
    ) -> dict[int, npt.NDArray[np.integer]]:
        """Each position's piece of the whole document read for it."""
        starts, lens = self.starts(positions).tolist(), self.lengths_at(positions).tolist()
        return {
            p: tokens[p][s : s + n]
            for p, s, n in zip(positions.tolist(), starts, lens, strict=True)
        }

    def __reduce__(self) -> tuple[Any, ...]:
        if isinstance(self.items, np.memmap) and self.items.filename is not None:
            return (_open_items, (str(self.items.filename), self.size, self.key))
        return (TokenItems, (np.asarray(self.items), self.key))


def _open_items(path: str, n: int, key: str) -> TokenItems:
    if n == 0:
        return TokenItems(np.empty(0, dtype=ITEM), key)
    return TokenItems(np.memmap(path, dtype=ITEM, mode="r", shape=(n,)), key)


def _segments(mix: Any, lengths: MixLengths, epoch: int, part: Any) -> list[TokenSegment]:
    w = None if mix.weights is None else list(mix.weights.values())
    total = sum(mix.token_shares(lengths.totals))
    return token_segments(part or None, epoch, lengths.totals, w, total)


def token_items(
    mix: Any,
    packing: Packing,
    lengths: MixLengths,
    lengths_key: str,
    *,
    seed: int,
    epoch: int,
    shuffle: bool,
    part: Any = None,
    cache_dir: str | None = None,
) -> TokenItems:
    """Epoch ``epoch``'s items, planned once per node into ``cache_dir/packing``
    (``part``: what the pass carries after a loaded state or ``set_weights``;
    ``cache_dir``: None for the default one)."""
    segments = _segments(mix, lengths, epoch, part)
    total = sum(mix.token_shares(lengths.totals))
    merges = [merge_of(s.shares) for s in segments]
    text = f"{lengths_key}/{mix.names}/{segments}/{seed}/{shuffle}/{packing.seq_len}/{merges}"
    key = hashlib.blake2b(text.encode(), digest_size=16).hexdigest()
    folder = cache_subdir("packing", cache_dir)
    path = os.path.join(folder, f"{key}-e{epoch}.items")

    def plan(tmp: str) -> None:
        chunks = segmented_chunks(
            lengths.parts,
            segments,
            total,
            seq_len=packing.seq_len,
            seed=seed,
            shuffle=shuffle,
            names=mix.names,
        )
        with open(tmp, "wb") as f:
            for chunk in chunks:
                chunk.tofile(f)

    publish(path, plan)
    size = os.path.getsize(path)
    prune(folder, key, epoch, "items")
    if size % ITEM.itemsize:
        raise ValueError(f"evenly: {path} is not a complete token-mix plan; remove it")
    return _open_items(path, size // ITEM.itemsize, f"{key}-e{epoch}")


def token_reweighted(
    mix: Any,
    packing: Packing,
    lengths: MixLengths,
    part: Any,
    *,
    epoch: int,
    position: int,
    weights: Mapping[str, float],
    seed: int,
    shuffle: bool,
) -> dict[str, Any]:
    """The part a pass carries after ``set_weights(weights)`` at row ``position`` of
    ``epoch`` (``concat``: the first ``position * seq_len`` tokens stay; from there each
    stream continues under the new weights, which hold for later epochs)."""
    if packing.strategy != "concat":
        raise ValueError(
            "set_weights on an evenly.Mix(unit='tokens') needs Packing(strategy='concat'): "
            "best_fit reorders documents inside its windows, so the rows already read "
            "could not stay; change the weights between epochs (a new Mix, resumed at an "
            "epoch boundary)"
        )
    vector = [check_weights(mix.names, weights)[n] for n in mix.names]
    segments = _segments(mix, lengths, epoch, part)
    total = sum(mix.token_shares(lengths.totals))
    token = position * packing.seq_len
    start = segments[0]
    if token >= total:  # the epoch is read: the next one starts with the new weights
        last = segments[-1]
        end = [o + s for o, s in zip(last.offsets, last.shares, strict=True)]
        return {"anchor_epoch": epoch + 1, "anchor_offsets": end, "weights": vector, "changes": []}
    if token == 0:
        return {
            "anchor_epoch": epoch,
            "anchor_offsets": list(start.offsets),
            "weights": vector,
            "changes": [],
        }
    kept = [s for s in segments if s.start < token]
    at = offsets_at(
        lengths.parts,
        kept[-1],
        token,
        seq_len=packing.seq_len,
        seed=seed,
        shuffle=shuffle,
        names=mix.names,
    )
    changes = [[s.start, list(s.weights or vector), list(s.offsets)] for s in kept[1:]]
    return {
        "anchor_epoch": epoch,
        "anchor_offsets": list(start.offsets),
        "weights": None if start.weights is None else list(start.weights),
        "changes": [*changes, [token, vector, list(at)]],
    }


class TokenMixRows(PackedRows):
    """Packed rows of an ``evenly.Mix(unit="tokens")``: the epoch's positions are pieces
    of documents (each source's share of the epoch's tokens, :func:`token_items`), each
    piece cut from the whole document read for it; no per-document transform."""

    def __init__(self, packing: Packing) -> None:
        super().__init__(packing)
        self._items: dict[tuple[Any, ...], TokenItems] = {}

    def files(self, view: SourceView) -> PlanFiles:
        """The sources' lengths (each source's own) and the epochs' plan files."""
        if self._files is None:
            mixed, key = mix_lengths(view.source, self.packing)
            total = sum(view.source.token_shares(mixed.totals))
            given = [v.cache_dir for v in view.source.views if v.cache_dir is not None]
            self._files = PlanFiles(
                self.packing, mixed, key, total, cache_dir=given[0] if given else None
            )
        return self._files

    def items(
        self, view: SourceView, seed: int, epoch: int, shuffle: bool, part: Any = None
    ) -> TokenItems:
        """Epoch ``epoch``'s pieces of documents, in order."""
        key = (seed, epoch, shuffle, repr(part or None))
        found = self._items.get(key)
        if found is None:
            files = self.files(view)
            found = token_items(
                view.source,
                self.packing,
                files.lengths,
                files.lengths_key,
                seed=seed,
                epoch=epoch,
                shuffle=shuffle,
                part=part,
                cache_dir=files.cache_dir,
            )
            if len(self._items) >= 3:
                self._items.pop(next(iter(self._items)))
            self._items[key] = found
        return found

    def epoch_rows(
        self, plans: Plans, epoch: int, part: Any = None
    ) -> tuple[RowTable, Order | None]:
        """The order's positions are pieces of documents: epoch ``epoch``'s items."""
        key = (plans.seed, plans.shuffle_mode, plans.block_shards)
        items = self.items(plans.view, plans.seed, epoch, plans.shuffle_mode != "none", part)
        return self.files(plans.view).table(epoch, key, items, items), items

    def check_transform(self, transform: Callable[[Any], Any] | None) -> None:
        if transform is not None:
            raise ValueError(TOKEN_MIX_READ)

    def reweighted(
        self,
        plans: Plans,
        source_state: dict[str, Any],
        state: PassState,
        weights: Mapping[str, float],
    ) -> dict[str, Any]:
        """The part a pass carries from ``state``'s row on, under the new weights."""
        source_state["part"] = token_reweighted(
            plans.view.source,
            self.packing,
            self.files(plans.view).lengths,
            state.source,
            epoch=state.epoch,
            position=state.position,
            weights=weights,
            seed=plans.seed,
            shuffle=plans.shuffle_mode != "none",
        )
        return source_state

    def tokens(
        self,
        ctx: ReadContext,
        files: PlanFiles,
        epoch: int,
        order: Order | None,
        where: I64,
        index: I64,
        pieces: npt.NDArray[np.void],
        inverse: I64,
        spreader: SeedSpreader | None,
        alloc: Empty,
    ) -> tuple[I64, StoredDtype, Any]:
        """Each position's piece of the whole document read for it."""
        items = cast(TokenItems, order)  # what epoch_rows gives as the order
        whole = documents(ctx, self.packing, files, epoch, where, index, spreader)
        cut = items.cut(where, whole)
        return piece_tokens(pieces, cut, alloc), stored_dtype(cut), items.starts(pieces["pos"])

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_items"] = {}
        return state
