"""Packing's document lengths: one int32 per document, computed once per source and
cached in ``cache_dir/lengths`` (keyed by the source's content: its files' identities, so
two corpora with the same names and row counts never share an entry; the field and the
tokenizer id), memory-mapped and shared by every process of the node.

A source that knows its lengths says so (``token_lengths(field)``,
:class:`~evenly.core.source.TokenLengthsSource`: Arrow, Parquet, HF ``datasets`` from the
list offsets); any other is read once, document by document (with ``tokenize``: one
batched tokenizer call per 1024 documents, from several threads for an
``evenly.tokenizer``).  A source without a fingerprint (an
in-memory list) has its lengths computed in the process, with no file.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

import numpy as np
import numpy.typing as npt
from filelock import FileLock

from evenly.core.packing.settings import Packing, Tokenize
from evenly.core.source import SourceView
from evenly.sources._cachedir import cache_subdir, publish
from evenly.sources._tokenize import Tokenizer

__all__ = ["document_lengths", "document_text", "document_tokens", "tokenized"]

logger = logging.getLogger("evenly")
I32 = npt.NDArray[np.int32]
#: Documents read per call in a lengths pass.
BATCH = 1024
#: Threads of a lengths pass under ``Packing(tokenize=evenly.tokenizer(...))``.
THREADS = max(1, min(4, os.cpu_count() or 1))


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


def tokenized(tokenize: Tokenize | None, texts: list[str], first: int) -> list[list[int]]:
    """``tokenize(texts)`` (``Packing.tokenize``), checked: one list of ids per text."""
    assert tokenize is not None
    out = tokenize(texts)
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
    if packing.tokenize is not None:
        _tokenized_lengths(view, packing, out)
        return out
    for lo in range(0, n, BATCH):
        indices = list(range(lo, min(lo + BATCH, n)))
        samples = _read(view, indices)
        out[lo : lo + len(indices)] = [
            _count(s, packing, i) for s, i in zip(samples, indices, strict=True)
        ]
    return out


def _read(view: SourceView, indices: list[int]) -> list[Any]:
    if view.getitems is not None:
        return list(view.getitems(indices))
    return [view.read_one(i) for i in indices]


def _tokenized_lengths(view: SourceView, packing: Packing, out: I32) -> None:
    """``out[i]``: document ``i``'s token count under ``packing.tokenize``, one batch of
    ``BATCH`` documents per call.  An ``evenly.tokenizer`` (whose HF calls release the
    GIL) is called from ``THREADS`` threads, each reading its batches from its own copy of
    the source, ``BATCH`` documents in flight per thread; any other function from this
    thread alone (it may not be safe to call from several)."""
    n, tokenize = out.size, packing.tokenize
    threads = THREADS if isinstance(tokenize, Tokenizer) and n > BATCH else 1
    local = threading.local()

    def count(lo: int) -> None:
        mine, call = view, tokenize
        if isinstance(tokenize, Tokenizer) and threads > 1:
            if not hasattr(local, "view"):  # this thread's source and tokenizer
                twin = getattr(view.source, "copy_for_thread", None)
                local.view = SourceView.of(twin()) if callable(twin) else view
                local.tokenize = tokenize.for_thread()
            mine, call = local.view, local.tokenize
        indices = list(range(lo, min(lo + BATCH, n)))
        samples = _read(mine, indices)
        texts = [document_text(s, packing, i) for s, i in zip(samples, indices, strict=True)]
        out[lo : lo + len(indices)] = [len(t) for t in tokenized(call, texts, lo)]

    if threads == 1:
        for lo in range(0, n, BATCH):
            count(lo)
        return
    with ThreadPoolExecutor(threads, thread_name_prefix="evenly-lengths") as pool:
        running: set[Future[None]] = set()
        try:
            for lo in range(0, n, BATCH):
                if len(running) >= 2 * threads:  # a bounded window: nothing of size N
                    done, running = wait(running, return_when=FIRST_COMPLETED)
                    for future in done:
                        future.result()
                running.add(pool.submit(count, lo))
            for future in running:
                future.result()
        finally:
            for future in running:
                future.cancel()


def document_lengths(
    view: SourceView, packing: Packing, cache_dir: str | None = None
) -> tuple[I32, str]:
    """``(lengths, key)``: tokens per document (memory-mapped from the node's cache
    where the source has an identity), and a key that changes with them.

    The cache file is keyed by the source's content (``content_key()``: its files'
    identities, so two corpora with the same names and row counts, or a corpus rewritten
    in place, never share one; else its ``fingerprint``), the field and the tokenizer id.
    A damaged file (cut short) is computed again."""
    n = len(view.source)
    identity = view.content_key() if view.content_key is not None else view.fingerprint
    if identity is None:
        lengths = _read_lengths(view, packing)
        digest = hashlib.blake2b(lengths.tobytes(), digest_size=16)
        digest.update(packing.lengths_key.encode())
        return lengths, digest.hexdigest()
    key = hashlib.blake2b(
        f"{identity}/{packing.lengths_key}/{n}".encode(), digest_size=16
    ).hexdigest()
    path = os.path.join(cache_subdir("lengths", cache_dir), f"{key}.i32")

    def write(tmp: str) -> None:
        _read_lengths(view, packing).tofile(tmp)

    publish(path, write)
    if os.path.getsize(path) != 4 * n:
        _rewrite(path, write, n)
    if n == 0:
        return np.zeros(0, dtype=np.int32), key
    return np.memmap(path, dtype=np.int32, mode="r", shape=(n,)), key


def _rewrite(path: str, write: Callable[[str], None], n: int) -> None:
    """Compute a damaged lengths file (not ``4 * n`` bytes) again, once per node."""
    with FileLock(path + ".lock"):
        size = os.path.getsize(path) if os.path.exists(path) else 4 * n
        if size != 4 * n:
            logger.warning(
                "evenly: the cached lengths %s hold %d documents, the source has %d: "
                "computing them again",
                path,
                size // 4,
                n,
            )
            os.unlink(path)  # a process that mapped it keeps its map
    publish(path, write)
    if os.path.getsize(path) != 4 * n:
        raise ValueError(
            f"evenly: the lengths written to {path} hold {os.path.getsize(path) // 4} "
            f"documents, the source has {n}: is cache_dir full? free space in it, or set "
            f"$EVENLY_CACHE_DIR to another disk"
        )
