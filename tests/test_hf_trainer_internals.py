"""What evenly relies on in the HF Trainer, checked against the installed transformers
(``constraints.txt`` pins the one CI runs), in this process with one device: no ranks.

- ``get_train_dataloader()`` over an iterable dataset builds a plain ``DataLoader``
  (``per_device_train_batch_size``, no sampler) and hands it to ``accelerator.prepare()``:
  a ``DataLoaderDispatcher`` whose base loader's ``dataset`` is ``train_dataset``;
- the Trainer asks ``len(train_dataloader)`` before any iteration, which asks the base
  loader's ``len()`` (torch records its answer: ``torch_compat.len_answered``, what
  evenly compares when the pass starts, looking at no caller); that count bounds the
  steps of an epoch;
- what ``evenly.interop.hf_trainer.TrainerMixin`` reads of the Trainer: its
  ``_train_batch_size``, ``_get_collator_with_removed_columns`` and ``dataloader_*``
  arguments;
- every epoch the dataset's ``set_epoch(epoch)`` is called with the Trainer's epoch while
  the dispatcher is ``GradientState``'s active dataloader, before the dataset is iterated;
- a mid-epoch resume rebuilds the loader with ``accelerate.skip_first_batches`` (a
  dispatcher over the same dataset, ``skip_batches`` set), which drives the dataset the
  same way.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("transformers") is None, reason="needs transformers (test extra)"
    ),
    pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning"),
]

N, BATCH = 40, 4


@pytest.fixture(autouse=True)
def fresh_accelerate() -> Iterator[None]:
    from accelerate.state import AcceleratorState, GradientState

    environ = dict(os.environ)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    os.environ.clear()
    os.environ.update(environ)


class Events(IterableDataset[dict[str, Any]]):
    """N samples as dicts, recording what the Trainer asks of the dataset."""

    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []

    def _active(self) -> Any:
        from accelerate.state import GradientState

        return GradientState().active_dataloader if GradientState._shared_state else None

    def __len__(self) -> int:
        self.events.append(("len",))
        return N

    def set_epoch(self, epoch: int) -> None:
        self.events.append(("set_epoch", epoch, self._active()))

    def __iter__(self) -> Iterator[dict[str, Any]]:
        from evenly.runtime import torch_compat

        active = self._active()
        base = vars(active)["base_dataloader"] if active is not None else None
        self.events.append(("iter", active, torch_compat.len_answered(base)))
        for i in range(N):
            yield {"idx": i, "x": i / N, "labels": 0.0}


class Recorder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.seen: list[list[int]] = []

    def forward(
        self, idx: torch.Tensor, x: torch.Tensor, labels: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        if self.training:
            self.seen.append([int(i) for i in idx.tolist()])
        return {"loss": (self.layer(x.unsqueeze(1)).squeeze(1) - labels).pow(2).mean()}


def _trainer(dataset: Events, out: Path, model: Recorder | None = None, **kw: Any) -> Any:
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=BATCH,
        use_cpu=True,
        dataloader_num_workers=0,
        report_to="none",
        logging_strategy="no",
        disable_tqdm=True,
        **{"save_strategy": "no", "remove_unused_columns": False, **kw},
    )
    return Trainer(model=model or Recorder(), args=args, train_dataset=dataset)


def test_get_train_dataloader_prepares_a_plain_loader_into_a_dispatcher(tmp_path: Path) -> None:
    from accelerate.data_loader import DataLoaderDispatcher

    dataset = Events()
    loader = _trainer(dataset, tmp_path).get_train_dataloader()
    assert type(loader) is DataLoaderDispatcher
    base = vars(loader)["base_dataloader"]
    assert type(base) is DataLoader and base.dataset is dataset
    assert base.batch_size == BATCH
    assert type(base.sampler).__name__ == "_InfiniteConstantSampler"  # no sampler of its own


def test_the_trainer_asks_len_through_the_dispatcher_before_iterating(tmp_path: Path) -> None:
    dataset, model = Events(), Recorder()
    _trainer(dataset, tmp_path, model, num_train_epochs=2).train()
    events = dataset.events
    first_iter = next(i for i, e in enumerate(events) if e[0] == "iter")
    assert ("len",) in events[:first_iter]
    assert events[first_iter][2] == N  # the base loader's len(), asked before the pass
    # that count bounded each epoch: ceil(N / BATCH) steps per epoch
    assert len(model.seen) == 2 * -(-N // BATCH)
    assert sorted(i for batch in model.seen[: -(-N // BATCH)] for i in batch) == list(range(N))


def test_set_epoch_reaches_the_dataset_under_the_active_dispatcher_each_epoch(
    tmp_path: Path,
) -> None:
    from accelerate.data_loader import DataLoaderDispatcher

    dataset = Events()
    _trainer(dataset, tmp_path, num_train_epochs=3).train()
    iters = [i for i, e in enumerate(dataset.events) if e[0] == "iter"]
    assert len(iters) == 3
    start = 0
    for epoch, at in enumerate(iters):
        active = [
            e for e in dataset.events[start:at] if e[0] == "set_epoch" and e[1] == epoch and e[2]
        ]
        assert active and all(type(e[2]) is DataLoaderDispatcher for e in active), epoch
        assert type(dataset.events[at][1]) is DataLoaderDispatcher  # iterated under it
        start = at + 1


def test_a_mid_epoch_resume_skips_batches_through_a_rebuilt_dispatcher(tmp_path: Path) -> None:
    import accelerate
    import transformers.trainer
    from accelerate.data_loader import DataLoaderDispatcher

    assert transformers.trainer.skip_first_batches is accelerate.skip_first_batches
    steps = 3
    _trainer(Events(), tmp_path, max_steps=steps, save_strategy="steps", save_steps=steps).train()
    dataset, model = Events(), Recorder()
    _trainer(dataset, tmp_path, model, num_train_epochs=1).train(
        resume_from_checkpoint=str(tmp_path / f"checkpoint-{steps}")
    )
    drivers = [e[2] for e in dataset.events if e[0] == "set_epoch" and e[2] is not None]
    assert drivers and type(drivers[0]) is DataLoaderDispatcher
    assert drivers[0].skip_batches == steps
    assert vars(drivers[0])["base_dataloader"].dataset is dataset
    assert [i for b in model.seen for i in b] == list(range(steps * BATCH, N))


def test_what_the_trainer_mixin_reads_of_the_trainer(tmp_path: Path) -> None:
    from transformers import Trainer

    trainer = _trainer(Events(), tmp_path, dataloader_prefetch_factor=None)
    assert isinstance(trainer, Trainer) and trainer._train_batch_size == BATCH
    args = trainer.args
    assert args.dataloader_num_workers == 0 and isinstance(args.dataloader_pin_memory, bool)
    assert args.dataloader_prefetch_factor is None
    assert args.dataloader_multiprocessing_context is None
    assert args.dataloader_in_order is True
    # with remove_unused_columns=False the collator is the Trainer's own
    assert trainer._get_collator_with_removed_columns(trainer.data_collator, "Training") is (
        trainer.data_collator
    )


def _samples(n: int) -> list[dict[str, Any]]:
    return [{"idx": i, "x": i / n, "labels": 0.0, "text": "unused"} for i in range(n)]


def test_one_process_trains_on_a_bare_evenly_dataset_exactly(tmp_path: Path) -> None:
    """One process: the count asked before the pass is the whole epoch, so the Trainer's
    own loader over a bare evenly.Dataset reads every sample once per epoch, in exactly
    the steps it counted."""
    import evenly

    samples = [{k: v for k, v in s.items() if k != "text"} for s in _samples(N)]
    model = Recorder()
    trainer = _trainer(evenly.Dataset(samples, shuffle=True, seed=0), tmp_path, model)  # type: ignore[arg-type]
    trainer.args.num_train_epochs = 2
    trainer.train()
    steps = -(-N // BATCH)
    assert len(model.seen) == 2 * steps
    for epoch in (model.seen[:steps], model.seen[steps:]):
        assert sorted(i for batch in epoch for i in batch) == list(range(N))
    assert model.seen[:steps] != model.seen[steps:]  # a new order each epoch


def test_the_trainer_mixin_trains_on_an_evenly_dataloader(tmp_path: Path) -> None:
    """``TrainerMixin.get_train_dataloader()``: an evenly.DataLoader (kept as it is by
    ``prepare()``), with the Trainer's batch size and its collator less the columns the
    model does not take (``remove_unused_columns=True``: "text" goes)."""
    from transformers import Trainer

    import evenly
    from evenly.interop.hf_trainer import TrainerMixin

    class Mixed(TrainerMixin, Trainer):  # type: ignore[misc]
        pass

    model = Recorder()
    dataset = evenly.Dataset(_samples(N), shuffle=True, seed=0)
    kw: dict[str, Any] = {"remove_unused_columns": True, "num_train_epochs": 2}
    trainer = Mixed(
        model=model, args=_trainer(Events(), tmp_path, **kw).args, train_dataset=dataset
    )
    loader = trainer.get_train_dataloader()
    assert type(loader) is evenly.DataLoader and loader.dataset is dataset
    assert loader.batch_size == BATCH and len(loader) == -(-N // BATCH)
    assert "text" not in next(iter(loader))
    trainer.train()
    steps = -(-N // BATCH)
    assert len(model.seen) == 2 * steps
    for epoch in (model.seen[:steps], model.seen[steps:]):
        assert sorted(i for batch in epoch for i in batch) == list(range(N))
