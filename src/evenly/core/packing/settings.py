"""``evenly.Packing``: how documents are packed into rows of ``seq_len`` tokens.

Pure Python: no torch, no I/O.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass
from typing import Any

from evenly.errors import check_int
from evenly.options import STRATEGIES, Strategy

__all__ = ["STRATEGIES", "Packing"]

#: A batched tokenizer: texts in, one list of token ids per text out.
Tokenize = Callable[[list[str]], list[list[int]]]


@dataclass(frozen=True)
class Packing:
    """Pack the source's documents into rows of ``seq_len`` tokens.

    Passed as ``evenly.Dataset(source, pack=evenly.Packing(...))``: the source's samples
    are documents (a dict whose ``field`` holds a 1-D sequence of token ids, or the
    sequence itself), and every sample the dataset yields is a packed row: a dict of
    int64 tensors of shape ``[seq_len]`` (``[batch_size, seq_len]`` from
    ``evenly.DataLoader``): ``input_ids``, ``position_ids`` (0 at each row start and each
    document piece start), ``labels`` (``input_ids``, -100 at pads and wherever
    ``position_ids == 0``), and on request ``document_ids`` (the document's source index
    + 1; 0 for pads) and, per batch, ``cu_seqlens`` (flat int32) with ``max_seqlen``.

    The epoch's rows are a function of (seed, epoch, source, packing) only: the same
    whatever the number of ranks, workers or the batch size.

    >>> import evenly
    >>> docs = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    >>> ds = evenly.Dataset(docs, pack=evenly.Packing(4, strategy="concat", pad_id=0))
    >>> [row["input_ids"].tolist() for row in ds]
    [[1, 2, 3, 4], [5, 6, 7, 8], [9, 0, 0, 0]]
    >>> [row["position_ids"].tolist() for row in ds]
    [[0, 1, 2, 0], [0, 0, 1, 2], [0, 0, 0, 0]]

    Args:
        seq_len: tokens per row.
        strategy: ``"concat"``: the epoch's token stream (documents in the epoch's order)
            cut into rows, a document may continue in the next row; ``"best_fit"``: a
            document that fits in a row is never split (longer ones are cut into
            ``seq_len`` pieces), packed best-fit-decreasing over windows of ``window``
            documents with ``open_rows`` rows open; its row count, so ``len()``, may
            differ between epochs.
        field: the key of a document's token ids (ignored for documents that are the
            sequence itself).
        pad_id: the padding token; no document may use it (checked as rows are built).
        vocab_size: the vocabulary's size: every token id must be below it (checked as
            rows are built, with the ids' other checks: non-negative, never -100 nor
            ``pad_id``).  Taken from ``tokenize`` when it has one (``evenly.tokenizer``
            does); ``None``: ids are only checked non-negative.
        document_ids: add ``document_ids`` to every row.
        cu_seqlens: add ``cu_seqlens`` and ``max_seqlen`` to every batch of
            ``evenly.DataLoader``'s default collate (flash-attention's varlen inputs).
        tokenize: documents are text (``text_field`` of a dict, or the string itself),
            tokenized in the workers by batched calls ``tokenize(texts) -> token ids``.
            Their lengths need one first pass over the corpus (cached per
            ``tokenizer_id``); pre-tokenized sources are the fast path.
        tokenizer_id: a name that changes whenever ``tokenize``'s output would (the
            tokenizer and its version): it keys the cached lengths.  Required with
            ``tokenize``, unless ``tokenize`` carries one (``evenly.tokenizer(tok)`` does:
            ``Packing(2048, tokenize=evenly.tokenizer(tok))``).
        text_field: the key of a document's text under ``tokenize``.
        window: ``best_fit``: documents (consecutive in the epoch's order) packed together.
        open_rows: ``best_fit``: rows open at once in a window (the fullest is closed
            when a document fits none).
    """

    seq_len: int
    _: KW_ONLY
    strategy: Strategy = "concat"
    field: str = "input_ids"
    pad_id: int = 0
    vocab_size: int | None = None
    document_ids: bool = False
    cu_seqlens: bool = False
    tokenize: Tokenize | None = None
    tokenizer_id: str | None = None
    text_field: str = "text"
    window: int = 1024
    open_rows: int = 16

    def __post_init__(self) -> None:
        check_int("Packing(seq_len)", self.seq_len, minimum=1)
        check_int("Packing(pad_id)", self.pad_id)
        check_int("Packing(window)", self.window, minimum=1)
        check_int("Packing(open_rows)", self.open_rows, minimum=1)
        if self.strategy not in STRATEGIES:
            raise ValueError(
                f"Packing(strategy=...) must be one of {list(STRATEGIES)}, got {self.strategy!r}"
            )
        for name in ("field", "text_field"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"Packing({name}=...) must be a str, got {getattr(self, name)!r}")
        if self.tokenize is not None:
            if not callable(self.tokenize):
                raise TypeError(f"Packing(tokenize=...) must be callable, got {self.tokenize!r}")
            given = getattr(self.tokenize, "tokenizer_id", None)  # evenly.tokenizer(tok)
            if self.tokenizer_id is None and isinstance(given, str):
                object.__setattr__(self, "tokenizer_id", given)
            if not isinstance(self.tokenizer_id, str) or not self.tokenizer_id:
                raise ValueError(
                    "Packing(tokenize=...) needs tokenizer_id='<name and version of the "
                    "tokenizer>': it keys the cached document lengths, which must change "
                    "whenever the tokenizer's output would"
                )
            known = getattr(self.tokenize, "vocab_size", None)  # evenly.tokenizer(tok)
            if self.vocab_size is None and type(known) is int and known > 0:
                object.__setattr__(self, "vocab_size", known)
        elif self.tokenizer_id is not None:
            raise ValueError("Packing(tokenizer_id=...) is only used with tokenize=...")
        if self.vocab_size is not None:
            size = check_int("Packing(vocab_size)", self.vocab_size, minimum=1)
            object.__setattr__(self, "vocab_size", size)

    @property
    def lengths_key(self) -> str:
        """What the cached lengths depend on besides the source: the field and the
        tokenizer id."""
        if self.tokenize is not None:
            return f"text:{self.text_field}:{self.tokenizer_id}"
        return f"tokens:{self.field}"

    def fingerprint(self) -> dict[str, Any]:
        """What a checkpoint state must agree on (the rows depend on it)."""
        fp: dict[str, Any] = {
            "seq_len": self.seq_len,
            "strategy": self.strategy,
            "pad_id": self.pad_id,
            "unit": "rows",
        }
        if self.strategy == "best_fit":
            fp["strategy"] = f"best_fit(window={self.window},open_rows={self.open_rows})"
        return fp

    def plan_key(self) -> str:
        """A digest of what the rows depend on (besides the documents and the order)."""
        text = f"{self.strategy}/{self.seq_len}/{self.window}/{self.open_rows}/{self.lengths_key}"
        return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()
