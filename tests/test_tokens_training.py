"""The whole path, as a user runs it: text tokenized into shards by ``evenly.write`` with an
HF tokenizer trained here, packed by ``evenly.Packing``, and a tiny causal LM
(``transformers`` ``LlamaForCausalLM``, built from a config: no download) trained through
Lightning under 2 real gloo ranks with an ``evenly.DataLoader`` (2 workers each).  Each
epoch every token of every document reaches exactly one rank exactly once, both ranks run
the same number of steps, and the loss is finite.  The same launch then trains on an
``evenly.Mix(unit="tokens")`` of the shards twice (equal weights): every token of each
source once per epoch."""

from __future__ import annotations

import importlib.util
import math
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.distributed import run_ranks

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("lightning") is None, reason="needs lightning (test extra)"
    ),
]

SEQ_LEN, BATCH, EPOCHS = 64, 4, 2


def train_ranks(rank: int, world: int, shards: str, vocab: int) -> list[list[dict[str, Any]]]:
    """One rank: fit the tiny LM for ``EPOCHS`` epochs, recording every step's batch, on
    the shards, then (the same launch) on a Mix by tokens of the shards twice."""
    import lightning as L
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import evenly

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=SEQ_LEN,
    )

    class TinyLM(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = LlamaForCausalLM(config)
            self.steps: list[dict[str, Any]] = []

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            out = self.model(
                input_ids=batch["input_ids"],
                position_ids=batch["position_ids"],
                labels=batch["labels"],
            )
            loss: torch.Tensor = out.loss
            self.steps.append(
                {
                    "epoch": self.current_epoch,
                    "input_ids": batch["input_ids"].tolist(),
                    "document_ids": batch["document_ids"].tolist(),
                    "loss": float(loss.detach()),
                }
            )
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    pack = evenly.Packing(SEQ_LEN, document_ids=True)
    mix = evenly.Mix(
        {"a": evenly.from_arrow(shards), "b": evenly.from_arrow(shards)},
        weights={"a": 1, "b": 1},
        unit="tokens",
    )
    out = []
    for source in (evenly.from_arrow(shards), mix):
        ds = evenly.Dataset(source, shuffle=True, seed=0, pack=pack)
        loader = evenly.DataLoader(ds, batch_size=BATCH, num_workers=2)
        module = TinyLM()
        trainer = L.Trainer(
            accelerator="cpu",
            devices=world,
            strategy="ddp",
            max_epochs=EPOCHS,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
            num_sanity_val_steps=0,
            default_root_dir=str(Path(shards).parent / f"rank{rank}"),
        )
        trainer.fit(module, loader)
        out.append(module.steps)
    return out


def test_a_tiny_llama_trains_on_packed_rows_every_token_once_per_epoch(tmp_path: Path) -> None:
    import evenly
    from tests.tokens_helpers import corpus, tiny_tokenizer

    texts = corpus(160, seed=7)
    tok = tiny_tokenizer(texts)
    tk = evenly.tokenizer(tok, append_eos=True)
    evenly.write(texts, tmp_path / "shards", "arrow", 64, tokenize=tk, progress=False)
    ranks = run_ranks(
        train_ranks,
        2,
        str(tmp_path / "shards"),
        tok.get_vocab_size(),
        env={"PYTHONWARNINGS": "ignore", "EVENLY_CACHE_DIR": str(tmp_path / "cache")},
        timeout=300,
    )
    want = Counter((doc, t) for doc, ids in enumerate(tk(texts)) for t in ids)
    _check_every_token_once(want, [r[0] for r in ranks])
    # the Mix by tokens of the shards twice (equal weights, every token of each once)
    n = len(texts)
    twice = want + Counter({(doc + n, t): c for (doc, t), c in want.items()})
    _check_every_token_once(twice, [r[1] for r in ranks])


def _check_every_token_once(want: Counter[tuple[int, int]], ranks: list[Any]) -> None:
    orders = []
    for epoch in range(EPOCHS):
        steps = [[s for s in r if s["epoch"] == epoch] for r in ranks]
        assert len(steps[0]) == len(steps[1]) > 0, "the ranks ran different numbers of steps"
        seen: Counter[tuple[int, int]] = Counter()
        for rank_steps in steps:
            for s in rank_steps:
                for row_ids, row_docs in zip(s["input_ids"], s["document_ids"], strict=True):
                    seen.update((d - 1, t) for t, d in zip(row_ids, row_docs, strict=True) if d)
        assert seen == want, f"epoch {epoch}: tokens missing or repeated"
        orders.append([s["document_ids"] for r in steps for s in r])
        assert all(math.isfinite(s["loss"]) for r in steps for s in r)
    assert orders[0] != orders[1], "the second epoch repeated the first one's rows"
