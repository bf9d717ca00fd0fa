"""Rank body for the HF Trainer over an ``evenly.Dataset`` (with evenly's ``TrainerMixin``,
or the Trainer alone), 2 DataLoader workers per rank, recording the ids ``forward``
receives."""

from __future__ import annotations

from typing import Any

import torch

import evenly

BATCH, WORKERS = 10, 2


class Recorder(torch.nn.Module):
    """A tiny regression model that keeps the ids of every batch it is trained on."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.seen: list[list[int]] = []

    def forward(
        self, idx: torch.Tensor, x: torch.Tensor, labels: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        if self.training:
            self.seen.append([int(i) for i in idx.tolist()])
        loss = (self.layer(x.unsqueeze(1)).squeeze(1) - labels).pow(2).mean()
        return {"loss": loss}


def train(
    rank: int, world: int, ns: tuple[int, ...], out_dir: str, kinds: tuple[str, ...] = ("mixin",)
) -> dict[tuple[str, int], Any]:
    """One epoch per (kind, N), the ids ``forward`` received, or the error's message:
    ``"mixin"``, the ``evenly.Dataset`` under a Trainer with evenly's ``TrainerMixin``;
    ``"plain"``, under the Trainer itself; ``"wrapped"``, the user's own
    ``Tokenize(evenly.Dataset)`` under the Trainer itself (the boundaries issue's hole 1)."""
    from transformers import Trainer, TrainingArguments

    from evenly.interop.hf_trainer import TrainerMixin
    from tests.interop_scripts.accelerate_ranks import Tokenize

    class Mixed(TrainerMixin, Trainer):  # type: ignore[misc]
        pass

    out: dict[tuple[str, int], Any] = {}
    for kind in kinds:
        for n in ns:
            samples = [{"idx": i, "x": i / n, "labels": 0.0} for i in range(n)]
            model = Recorder()
            args = TrainingArguments(
                output_dir=f"{out_dir}/n{n}-{kind}",
                per_device_train_batch_size=BATCH,
                num_train_epochs=1,
                use_cpu=True,
                dataloader_num_workers=WORKERS,
                remove_unused_columns=False,
                report_to="none",
                save_strategy="no",
                logging_strategy="no",
                disable_tqdm=True,
            )
            dataset: Any = evenly.Dataset(samples, shuffle=True, seed=0)
            train_dataset = Tokenize(dataset) if kind == "wrapped" else dataset
            trainer = (Mixed if kind == "mixin" else Trainer)(
                model=model, args=args, train_dataset=train_dataset
            )
            try:
                trainer.train()
                out[kind, n] = model.seen
            except RuntimeError as e:
                out[kind, n] = str(e)
                if model.seen:
                    out[kind, n] += f" (after {len(model.seen)} batch(es))"
    return out


def _trainer(n: int, out_dir: str, own: bool = False, **args: Any) -> tuple[Any, Recorder]:
    """A Trainer over an ``evenly.Dataset``; with ``own``, one with evenly's
    ``TrainerMixin``: its ``get_train_dataloader`` returns an ``evenly.DataLoader`` (a
    mid-epoch resume then goes through accelerate's ``skip_first_batches`` over that
    loader)."""
    from transformers import Trainer, TrainingArguments

    from evenly.interop.hf_trainer import TrainerMixin

    class OwnLoader(TrainerMixin, Trainer):  # type: ignore[misc]
        pass

    samples = [{"idx": i, "x": i / n, "labels": 0.0} for i in range(n)]
    model = Recorder()
    settings = {
        "output_dir": out_dir,
        "per_device_train_batch_size": BATCH,
        "use_cpu": True,
        "dataloader_num_workers": WORKERS,
        "remove_unused_columns": False,
        "report_to": "none",
        "logging_strategy": "no",
        "disable_tqdm": True,
        **args,
    }
    dataset = evenly.Dataset(samples, shuffle=True, seed=0)
    kind = OwnLoader if own else Trainer
    return kind(model=model, args=TrainingArguments(**settings), train_dataset=dataset), model


def train_then_checkpoint(
    rank: int, world: int, n: int, steps: int, out_dir: str, own: bool = False
) -> Any:
    """``steps`` optimizer steps of epoch 0, checkpointed (``save_steps``)."""
    trainer, model = _trainer(
        n, out_dir, own, max_steps=steps, save_strategy="steps", save_steps=steps
    )
    trainer.train()
    return model.seen


def resume_two_epochs(
    rank: int, world: int, n: int, checkpoint: str, out_dir: str, own: bool = False
) -> Any:
    """A fresh run: ``train(resume_from_checkpoint=...)`` over 2 epochs."""
    trainer, model = _trainer(n, out_dir, own, num_train_epochs=2, save_strategy="no")
    trainer.train(resume_from_checkpoint=checkpoint)
    return model.seen
