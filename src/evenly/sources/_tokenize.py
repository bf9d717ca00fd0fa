"""``evenly.tokenizer``: an HF tokenizer as the batched ``texts -> token ids`` function that
``evenly.Packing(tokenize=...)`` and ``evenly.write(..., tokenize=...)`` call, with a
stable id.

It accepts a ``tokenizers.Tokenizer``, a ``transformers`` tokenizer (fast or slow), or a
name: a ``tokenizer.json`` path, or what ``transformers.AutoTokenizer.from_pretrained``
takes.  The id is a digest of what decides the output (the tokenizer's serialized
definition, its class, the special-token settings), so the lengths ``evenly.Packing``
caches are recomputed when, and only when, the tokenizer changes.

>>> from tokenizers import Tokenizer, models, pre_tokenizers
>>> tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
>>> tok.pre_tokenizer = pre_tokenizers.Whitespace()
>>> tk = tokenizer(tok)
>>> tk(["hello world", "world"])
[[1, 2], [2]]
>>> tk.tokenizer_id.startswith("tokenizers:")
True
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["Tokenizer", "tokenized_rows", "tokenizer"]


class Tokenizer:
    """A batched tokenizer: ``tk(texts) -> list[list[int]]``, with ``tk.tokenizer_id``.

    Build it with :func:`tokenizer`.  Picklable (spawned workers get their own copy).
    """

    def __init__(self, tok: Any, *, add_special_tokens: bool, append_eos: bool) -> None:
        self.tok = tok
        self.add_special_tokens = bool(add_special_tokens)
        self.kind = "tokenizers" if _is_tokenizers(tok) else "transformers"
        self.eos_id: int | None = None
        if append_eos:
            self.eos_id = _eos_id(tok, self.kind)
        #: changes whenever the output would (the tokenizer, its settings, the options)
        self.tokenizer_id = self._id()
        #: ids it can give are below this (added tokens included): ``Packing`` checks
        #: every id against it
        self.vocab_size = _vocab_size(tok, self.kind)

    def __call__(self, texts: list[str]) -> list[list[int]]:
        if self.kind == "tokenizers":
            encode = getattr(self.tok, "encode_batch_fast", self.tok.encode_batch)
            ids: list[list[int]] = [
                e.ids for e in encode(list(texts), add_special_tokens=self.add_special_tokens)
            ]
        else:
            out = self.tok(
                list(texts),
                add_special_tokens=self.add_special_tokens,
                return_attention_mask=False,
                return_token_type_ids=False,
                verbose=False,  # no "longer than model_max_length" log: documents are
            )
            ids = [list(x) for x in out["input_ids"]]
        if self.eos_id is not None:
            for x in ids:
                x.append(self.eos_id)
        return ids

    def _id(self) -> str:
        if self.kind == "tokenizers":
            definition = self.tok.to_str()
        else:
            backend = getattr(self.tok, "backend_tokenizer", None)
            definition = (
                backend.to_str()
                if backend is not None
                else json.dumps(sorted(self.tok.get_vocab().items()))
            )
            specials = getattr(self.tok, "special_tokens_map", {})
            definition += type(self.tok).__qualname__ + json.dumps(specials, sort_keys=True)
        settings = f"/special={self.add_special_tokens}/eos={self.eos_id}"
        digest = hashlib.sha256((definition + settings).encode()).hexdigest()[:16]
        return f"{self.kind}:{digest}"

    def for_thread(self) -> Tokenizer:
        """The tokenizer one of several threads calls: this one for a ``tokenizers``
        tokenizer (its batch calls only read it), a copy for a ``transformers`` one (its
        calls set truncation and padding on the backend: "Already borrowed" when shared)."""
        if self.kind == "tokenizers":
            return self
        twin = copy.copy(self)
        twin.tok = copy.deepcopy(self.tok)
        return twin

    def __repr__(self) -> str:
        return f"evenly.tokenizer({type(self.tok).__name__}, id={self.tokenizer_id!r})"


def _is_tokenizers(tok: Any) -> bool:
    return type(tok).__module__.startswith("tokenizers") and hasattr(tok, "encode_batch")


def _vocab_size(tok: Any, kind: str) -> int | None:
    """One more than the largest id ``tok`` can give (None where it cannot say)."""
    try:
        if kind == "tokenizers":
            size = int(tok.get_vocab_size(with_added_tokens=True))
            vocab = tok.get_vocab(with_added_tokens=True)
        else:
            size, vocab = len(tok), tok.get_vocab()  # with the added tokens
        size = max(size, max(vocab.values(), default=-1) + 1)  # ids need not be dense
    except (AttributeError, TypeError):
        return None
    return size if size > 0 else None


def _eos_id(tok: Any, kind: str) -> int:
    if kind == "transformers":
        eos = getattr(tok, "eos_token_id", None)
        if isinstance(eos, int):
            return eos
    else:
        for name in ("</s>", "<|endoftext|>", "[EOS]", "<eos>", "<|end_of_text|>"):
            found = tok.token_to_id(name)
            if found is not None:
                return int(found)
    raise ValueError(
        "evenly.tokenizer(append_eos=True): the tokenizer has no end-of-document token "
        "(a transformers tokenizer's eos_token, or one of </s>, <|endoftext|>, [EOS], "
        "<eos>, <|end_of_text|>); set one, or leave append_eos=False"
    )


def tokenizer(tok: Any, *, add_special_tokens: bool = True, append_eos: bool = False) -> Tokenizer:
    """An HF tokenizer as a batched ``texts -> token ids`` function with a stable id.

    One line for packing text on the fly::

        tk = evenly.tokenizer(AutoTokenizer.from_pretrained("gpt2"), append_eos=True)
        pack = evenly.Packing(2048, tokenize=tk)  # tk.tokenizer_id keys the lengths

    Args:
        tok: a ``tokenizers.Tokenizer``; a ``transformers`` tokenizer (its ``__call__``
            is used, so its special tokens are added as the model expects); or a str:
            a ``tokenizer.json`` file, else a name or directory for
            ``transformers.AutoTokenizer.from_pretrained``.
        add_special_tokens: add the tokenizer's special tokens (BOS...) to every text.
        append_eos: end every document with the tokenizer's end-of-document token.
    """
    if isinstance(tok, str | os.PathLike):
        tok = _load(os.fspath(tok))
    if not (_is_tokenizers(tok) or (callable(tok) and hasattr(tok, "get_vocab"))):
        raise TypeError(
            f"evenly.tokenizer: expected a tokenizers.Tokenizer or a transformers "
            f"tokenizer, got {type(tok).__name__}; a plain function goes straight to "
            f"Packing(tokenize=fn, tokenizer_id=...)"
        )
    return Tokenizer(tok, add_special_tokens=add_special_tokens, append_eos=append_eos)


def _load(name: str) -> Any:
    if name.endswith(".json"):
        if not os.path.isfile(name):
            raise FileNotFoundError(f"evenly.tokenizer: no tokenizer file {name!r}")
        from tokenizers import Tokenizer as HFTokenizer

        return HFTokenizer.from_file(name)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name)


class _Sized:
    """An iterator with a known length (so ``write`` shows a total)."""

    def __init__(self, it: Iterator[Any], n: int | None) -> None:
        self.it, self.n = it, n

    def __iter__(self) -> Iterator[Any]:
        return self.it

    def __len__(self) -> int:
        return self.n or 0


def tokenized_rows(
    samples: Iterable[Any],
    total: int | None,
    tokenize: Any,
    *,
    text_field: str = "text",
    keep_fields: Iterable[str] = (),
    batch_size: int = 1000,
) -> Iterable[dict[str, Any]]:
    """Rows ``{"input_ids": int32 array, **kept fields}`` for ``samples`` (texts, or dicts
    with ``text_field``), tokenized ``batch_size`` texts per call."""
    keep = list(keep_fields)
    if "input_ids" in keep:
        raise ValueError("evenly.write: keep_fields cannot name 'input_ids' (it is written)")

    def rows() -> Iterator[dict[str, Any]]:
        batch: list[Any] = []
        first = 0
        for index, sample in enumerate(samples):
            batch.append(sample)
            if len(batch) == batch_size:
                yield from _encode(batch, first, tokenize, text_field, keep)
                first, batch = index + 1, []
        if batch:
            yield from _encode(batch, first, tokenize, text_field, keep)

    return _Sized(rows(), total) if total is not None else rows()


def _text(sample: Any, index: int, text_field: str) -> str:
    text = sample.get(text_field) if isinstance(sample, dict) else sample
    if isinstance(text, str):
        return text
    if isinstance(sample, dict) and text_field not in sample:
        raise ValueError(
            f"evenly.write(tokenize=...): sample {index} has no field {text_field!r} (its "
            f"fields: {sorted(sample)}); pass text_field= naming the text"
        )
    raise TypeError(
        f"evenly.write(tokenize=...): sample {index}: the text is {type(text).__name__}, not str"
    )


#: the first id int32 cannot hold (the shards' ``input_ids`` are int32)
INT32_END = 2**31


def _int32_ids(tokens: Any, index: int, limit: int, vocab: Any) -> npt.NDArray[np.int32]:
    """One text's ids as int32, each checked in ``[0, limit)`` first (no id wrapped into
    another, no negative id written): two numpy reductions per text."""
    try:
        ids = np.asarray(tokens).reshape(-1)
    except (OverflowError, ValueError) as exc:
        raise ValueError(f"evenly.write(tokenize=...): sample {index}: {exc}") from None
    if ids.size and ids.dtype.kind not in "iu":
        raise ValueError(
            f"evenly.write(tokenize=...): sample {index}: the tokenizer gave {ids.dtype} ids "
            f"(a Python int of 2^64 or more, or not integers): token ids are integers"
        )
    if not ids.size:
        return ids.astype(np.int32)
    low, high = int(ids.min()), int(ids.max())
    if low >= 0 and high < limit:
        return ids.astype(np.int32)
    if low < 0:
        bad, what = low, "negative (-100 is the loss's ignore index)"
    elif limit < INT32_END:
        bad, what = high, f"not below the tokenizer's vocabulary size {vocab}"
    else:
        bad, what = high, "outside int32's range, which the shards' input_ids hold"
    raise ValueError(
        f"evenly.write(tokenize=...): sample {index}: the tokenizer gave token id {bad}, "
        f"{what}; token ids are in [0, {limit}): fix the tokenizer"
    )


def _encode(
    batch: list[Any], first: int, tokenize: Any, text_field: str, keep: list[str]
) -> Iterator[dict[str, Any]]:
    texts = [_text(s, first + j, text_field) for j, s in enumerate(batch)]
    ids = tokenize(texts)
    if len(ids) != len(texts):
        raise ValueError(
            f"evenly.write(tokenize=...): the tokenizer returned {len(ids)} token lists for "
            f"{len(texts)} texts (samples {first}..{first + len(texts) - 1})"
        )
    vocab = getattr(tokenize, "vocab_size", None)
    limit = min(vocab, INT32_END) if type(vocab) is int and vocab > 0 else INT32_END
    for j, (sample, tokens) in enumerate(zip(batch, ids, strict=True)):
        row: dict[str, Any] = {"input_ids": _int32_ids(tokens, first + j, limit, vocab)}
        for name in keep:
            if not isinstance(sample, dict) or name not in sample:
                raise ValueError(
                    f"evenly.write(tokenize=...): sample {first + j} has no field {name!r} "
                    f"named in keep_fields"
                )
            row[name] = sample[name]
        yield row
