"""Packing's document lengths: one int32 per document, computed once per source and
cached in ``cache_dir/lengths`` (keyed by the source's fingerprint, the field and the
tokenizer id), memory-mapped and shared by every process of the node.

A source that knows its lengths says so (``token_lengths(field)``,
:class:`~evenly.core.source.TokenLengthsSource`: Arrow, Parquet, HF ``datasets`` from the
list offsets); any other is read once, document by document (with ``tokenize``: one
batched tokenizer call per 1024 documents).  A source without a fingerprint (an
in-memory list) has its lengths computed in the process, with no file.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import numpy as np
import numpy.typing as npt

from evenly.core.packing.settings import Packing
from evenly.core.source import SourceView
from evenly.sources._cachedir import cache_subdir, publish

__all__ = ["document_lengths", "document_text", "document_tokens", "tokenized"]

I32 = npt.NDArray[np.int32]
#: Documents read per call in a lengths pass.
BATCH = 1024


def document_tokens(sample: Any, packing: Packing, index: int) -> npt.NDArray[np.int64]:
    """The token ids of one (pre-tokenized) document as a 1-D int64 array."""
    value = sample
    if isinstance(sample, dict):
        if packing.field not in sample:
            raise KeyError(
                f"evenly: packing: document {index} has no field {packing.field!r} (its keys: "
                f"{sorted(sample)[:8]}); pass Packing(field=...)"
            )
        value = sample[packing.field]
    arr = np.asarray(value)
    if arr.ndim != 1 or not (arr.size == 0 or np.issubdtype(arr.dtype, np.integer)):
        raise TypeError(
            f"evenly: packing: document {index} is not a 1-D sequence of token ids (got "
            f"{type(value).__name__} of shape {arr.shape}, dtype {arr.dtype}); for text, "
            f"pass Packing(tokenize=..., tokenizer_id=...)"
        )
    return arr.astype(np.int64, copy=False)


def document_text(sample: Any, packing: Packing, index: int) -> str:
    """The text of one document (``Packing(tokenize=...)``)."""
    value = sample.get(packing.text_field) if isinstance(sample, dict) else sample
    if not isinstance(value, str):
        raise TypeError(
            f"evenly: packing: document {index} has no text to tokenize (got "
            f"{type(value).__name__}); a document is a str, or a dict with a str under "
            f"Packing(text_field={packing.text_field!r})"
        )
    return value


def tokenized(packing: Packing, texts: list[str], first: int) -> list[list[int]]:
    """``packing.tokenize(texts)``, checked: one list of ids per text."""
    assert packing.tokenize is not None
    out = packing.tokenize(texts)
    if len(out) != len(texts):
        raise ValueError(
            f"evenly: Packing(tokenize=...) returned {len(out)} token lists for {len(texts)} "
            f"texts (documents from {first} on); it must return one per text"
        )
    return out


def _count(sample: Any, packing: Packing, index: int) -> int:
    """A document's token count: ``len`` of an in-memory list or 1-D array (its tokens
    are checked when it is read), else its tokens converted."""
    value = sample.get(packing.field) if isinstance(sample, dict) else sample
    if isinstance(value, (list, tuple)) or (isinstance(value, np.ndarray) and value.ndim == 1):
        return len(value)
    return int(document_tokens(sample, packing, index).size)


def _read_lengths(view: SourceView, packing: Packing) -> I32:
    n = len(view.source)
    if packing.tokenize is None and view.token_lengths is not None:
        given = np.asarray(view.token_lengths(packing.field))
        if given.shape != (n,) or (given.size and int(given.min()) < 0):
            raise ValueError(
                f"evenly: {type(view.source).__name__}.token_lengths({packing.field!r}) gave "
                f"shape {given.shape}, expected ({n},) non-negative counts"
            )
        return given.astype(np.int32, copy=False)  # no private copy of a mapped int32 array
    out = np.empty(n, dtype=np.int32)
    for lo in range(0, n, BATCH):
        indices = list(range(lo, min(lo + BATCH, n)))
        if view.getitems is not None:
            samples = list(view.getitems(indices))
        else:
            samples = [view.read_one(i) for i in indices]
        if packing.tokenize is not None:
            texts = [document_text(s, packing, i) for s, i in zip(samples, indices, strict=True)]
            out[lo : lo + len(indices)] = [len(t) for t in tokenized(packing, texts, lo)]
        else:
            out[lo : lo + len(indices)] = [
                _count(s, packing, i) for s, i in zip(samples, indices, strict=True)
            ]
    return out


def document_lengths(
    view: SourceView, packing: Packing, cache_dir: str | None = None
) -> tuple[I32, str]:
    """``(lengths, key)``: tokens per document (memory-mapped from the node's cache
    where the source has a fingerprint), and a key that changes with them."""
    n = len(view.source)
    if view.fingerprint is None:
        lengths = _read_lengths(view, packing)
        digest = hashlib.blake2b(lengths.tobytes(), digest_size=16)
        digest.update(packing.lengths_key.encode())
        return lengths, digest.hexdigest()
    key = hashlib.blake2b(
        f"{view.fingerprint}/{packing.lengths_key}/{n}".encode(), digest_size=16
    ).hexdigest()
    path = os.path.join(cache_subdir("lengths", cache_dir), f"{key}.i32")
    publish(path, lambda tmp: _read_lengths(view, packing).tofile(tmp))
    size = os.path.getsize(path)
    if size != 4 * n:
        raise ValueError(
            f"evenly: the cached lengths {path} hold {size // 4} documents, the source has {n}; "
            f"remove the file (it will be computed again)"
        )
    if n == 0:
        return np.zeros(0, dtype=np.int32), key
    return np.memmap(path, dtype=np.int32, mode="r", shape=(n,)), key
