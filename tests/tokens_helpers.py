"""Text and a tiny tokenizer for the token-source tests: a BPE model trained in the test on
the corpus it then tokenizes (no download), and its ``transformers`` fast wrapper."""

from __future__ import annotations

from typing import Any

import numpy as np

WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "seven",
    "tired",
    "owls",
    "watch",
    "every",
    "packed",
    "row",
    "hold",
    "tokens",
    "from",
    "documents",
    "of",
    "many",
    "lengths",
]


def corpus(n: int, seed: int = 0, max_words: int = 60) -> list[str]:
    """``n`` texts of 1..max_words words (document ``i`` starts with ``doc{i}``)."""
    rng = np.random.default_rng(seed)
    return [
        " ".join([f"doc{i}", *rng.choice(WORDS, int(rng.integers(0, max_words)))]) for i in range(n)
    ]


def tiny_tokenizer(texts: list[str] | None = None, vocab_size: int = 200) -> Any:
    """A ``tokenizers`` BPE tokenizer trained on ``texts``; ``[PAD]`` is id 0, and a
    template post-processor adds ``[BOS]`` before every text."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["[PAD]", "[UNK]", "[BOS]", "[EOS]"]
    )
    tok.train_from_iterator(texts or corpus(200), trainer)
    bos = tok.token_to_id("[BOS]")
    tok.post_processor = processors.TemplateProcessing(
        single="[BOS] $A", special_tokens=[("[BOS]", bos)]
    )
    return tok


def fast_tokenizer(tok: Any) -> Any:
    """``tok`` wrapped as a ``transformers`` fast tokenizer."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="[BOS]",
        eos_token="[EOS]",
        pad_token="[PAD]",
        unk_token="[UNK]",
    )
