"""Packing over an ``evenly.Mix(unit="tokens")``: its documents' lengths and its epochs'
document orders, planned once per node and memory-mapped by every process.

- Lengths: each source's own (:func:`~evenly.runtime.lengths.document_lengths`: cached
  per source, memory-mapped), read by global index through :class:`MixLengths`.
- Epoch ``e``'s order (:func:`~evenly.core.mix.tokens.token_epoch`): one 16-byte item
  per piece, in ``cache_dir/packing/<key>-e<epoch>.items`` (written once by whichever
  process of the node comes first).  Planning holds about 60 bytes per item of the
  epoch in that process; every process then maps the file.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from evenly.core.mix.tokens import ITEM, token_epoch
from evenly.core.packing.settings import Packing
from evenly.runtime.lengths import document_lengths
from evenly.runtime.packed_plans import prune
from evenly.sources._cachedir import cache_subdir, publish

__all__ = ["MixLengths", "TokenItems", "is_token_mix", "mix_lengths", "token_items"]

I64 = npt.NDArray[np.int64]


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
        lengths, key = document_lengths(view, packing)
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
        self, positions: I64, tokens: dict[int, npt.NDArray[np.int64]]
    ) -> dict[int, npt.NDArray[np.int64]]:
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


def token_items(
    mix: Any,
    packing: Packing,
    lengths: MixLengths,
    lengths_key: str,
    *,
    seed: int,
    epoch: int,
    shuffle: bool,
) -> TokenItems:
    """Epoch ``epoch``'s items, planned once per node into ``cache_dir/packing``."""
    shares = mix.token_shares(lengths.totals)
    text = f"{lengths_key}/{mix.names}/{shares}/{seed}/{shuffle}/{packing.seq_len}/tokens-mix-v1"
    key = hashlib.blake2b(text.encode(), digest_size=16).hexdigest()
    folder = cache_subdir("packing")
    path = os.path.join(folder, f"{key}-e{epoch}.items")

    def plan(tmp: str) -> None:
        items = token_epoch(
            lengths.parts,
            shares,
            seq_len=packing.seq_len,
            seed=seed,
            epoch=epoch,
            shuffle=shuffle,
            names=mix.names,
        )
        items.tofile(tmp)

    publish(path, plan)
    size = os.path.getsize(path)
    prune(folder, key, epoch, "items")
    if size % ITEM.itemsize:
        raise ValueError(f"evenly: {path} is not a complete token-mix plan; remove it")
    return _open_items(path, size // ITEM.itemsize, f"{key}-e{epoch}")
