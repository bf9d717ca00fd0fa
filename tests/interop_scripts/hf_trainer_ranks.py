"""Rank body for the HF Trainer: ``Trainer(model, args, train_dataset=evenly.Dataset(...))``
with 2 DataLoader workers per rank, one epoch, recording the ids ``forward`` receives."""

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
    rank: int, world: int, ns: tuple[int, ...], out_dir: str, wrapped: tuple[bool, ...] = (False,)
) -> dict[tuple[bool, int], Any]:
    """One epoch per (wrapper, N): the train_dataset is the ``evenly.Dataset``, or (True)
    the user's own ``Tokenize(evenly.Dataset)`` (the boundaries issue's hole 1)."""
    from transformers import Trainer, TrainingArguments

    from tests.interop_scripts.accelerate_ranks import Tokenize

    out: dict[tuple[bool, int], Any] = {}
    for wrap in wrapped:
        for n in ns:
            samples = [{"idx": i, "x": i / n, "labels": 0.0} for i in range(n)]
            model = Recorder()
            args = TrainingArguments(
                output_dir=f"{out_dir}/n{n}-{wrap}",
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
            train_dataset = Tokenize(dataset) if wrap else dataset
            Trainer(model=model, args=args, train_dataset=train_dataset).train()
            out[wrap, n] = model.seen
    return out


def _trainer(n: int, out_dir: str, own: bool = False, **args: Any) -> tuple[Any, Recorder]:
    """A Trainer over an ``evenly.Dataset``; with ``own``, its ``get_train_dataloader``
    returns an ``evenly.DataLoader`` (a mid-epoch resume then goes through accelerate's
    ``skip_first_batches`` over that loader)."""
    from transformers import Trainer, TrainingArguments

    class OwnLoader(Trainer):  # type: ignore[misc]
        def get_train_dataloader(self) -> Any:
            return evenly.DataLoader(
                self.train_dataset,
                batch_size=BATCH,
                num_workers=WORKERS,
                collate_fn=self.data_collator,  # the Trainer's (float32, as its own loader)
            )

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
