"""The HF Trainer over an ``evenly.Dataset``: :class:`TrainerMixin`.

The Trainer builds a plain DataLoader over ``train_dataset``, hands it to
``accelerator.prepare()`` and asks its ``len()`` before the first pass to count an
epoch's steps.  evenly answers ``len()`` without looking at who asks, so before the
pass the count is the dataset's own share (this rank's samples): exact on one process,
where that share is the whole epoch, but not under Accelerate's ``DataLoaderDispatcher``
with several processes (rank 0 reads the whole epoch for all): there the first batch
raises, naming this mixin.  With the mixin the Trainer trains on an ``evenly.DataLoader``
(kept as it is by ``prepare()``): ``len()`` is exact on every rank, ``set_epoch`` and a
mid-epoch resume (``skip_first_batches``) go through evenly's own passes.

>>> from evenly.interop.hf_trainer import TrainerMixin
>>> # class MyTrainer(TrainerMixin, transformers.Trainer): ...
>>> # MyTrainer(model=model, args=args, train_dataset=evenly.Dataset(samples)).train()

transformers is never imported here; what this relies on of the Trainer
(``_train_batch_size``, ``_get_collator_with_removed_columns``, the ``dataloader_*``
arguments) is pinned by ``tests/test_hf_trainer_internals.py``.
"""

from __future__ import annotations

from typing import Any

from evenly.dataset import Dataset
from evenly.loader.loader import DataLoader

__all__ = ["TrainerMixin"]


class TrainerMixin:
    """Mix into ``transformers.Trainer``, before it: ``class MyTrainer(TrainerMixin,
    Trainer)``.  When ``train_dataset`` is an ``evenly.Dataset``,
    ``get_train_dataloader()`` returns an ``evenly.DataLoader`` over it with the
    Trainer's batch size, collator (unused columns removed as the Trainer does) and
    DataLoader arguments (``persistent_workers`` keeps evenly's default); any other
    dataset gets the Trainer's own loader."""

    # what the Trainer sets (declared for the type checker; no values here)
    train_dataset: Any
    args: Any
    accelerator: Any
    data_collator: Any
    _train_batch_size: int

    def get_train_dataloader(self) -> Any:
        """An ``evenly.DataLoader`` over an ``evenly.Dataset`` (prepared: Accelerate
        keeps it as it is), else the Trainer's own loader."""
        dataset = self.train_dataset
        if not isinstance(dataset, Dataset):
            return super().get_train_dataloader()  # type: ignore[misc]
        args = self.args
        workers = int(args.dataloader_num_workers)
        extra: dict[str, Any] = {"pin_memory": bool(args.dataloader_pin_memory)}
        if workers and args.dataloader_prefetch_factor is not None:
            extra["prefetch_factor"] = args.dataloader_prefetch_factor
        if workers and args.dataloader_multiprocessing_context is not None:
            extra["multiprocessing_context"] = args.dataloader_multiprocessing_context
        if getattr(args, "dataloader_in_order", True) is False:
            extra["in_order"] = False  # evenly.DataLoader refuses it, naming why
        # the Trainer's collator, less the columns its model does not take (as its own)
        collate = super()._get_collator_with_removed_columns(  # type: ignore[misc]
            self.data_collator, description="Training"
        )
        loader = DataLoader(
            dataset,
            batch_size=self._train_batch_size,
            num_workers=workers,
            collate_fn=collate,
            **extra,
        )
        return self.accelerator.prepare(loader)
