"""Rank bodies for Accelerate: ``accelerator.prepare(model, opt, evenly_loader)`` as a user
writes it, recording the ids each training step receives."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import torch

import evenly

BATCH, WORKERS = 10, 2


def _setup(ns: tuple[int, ...], dispatch: bool | None) -> tuple[Any, Any, Any, list[Any]]:
    from accelerate import (  # type: ignore[import-untyped]
        Accelerator,
        DataLoaderConfiguration,
    )

    accelerator = Accelerator(
        cpu=True, dataloader_config=DataLoaderConfiguration(dispatch_batches=dispatch)
    )
    model = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loaders = [
        evenly.DataLoader(
            evenly.Dataset(list(range(n)), shuffle=True, seed=0),
            batch_size=BATCH,
            num_workers=WORKERS,
        )
        for n in ns
    ]
    model, opt, *prepared = accelerator.prepare(model, opt, *loaders)
    return accelerator, model, opt, prepared


def _step(accelerator: Any, model: Any, opt: Any, batch: torch.Tensor, n: int) -> list[int]:
    """One real DDP step (a gradient all-reduce per batch); returns the batch's ids."""
    loss = model(batch.float().unsqueeze(1) / n).pow(2).mean()
    accelerator.backward(loss)
    opt.step()
    opt.zero_grad()
    return [int(i) for i in batch.tolist()]


def train(
    rank: int,
    world: int,
    ns: tuple[int, ...],
    dispatch: bool | None,
    epochs: int,
) -> dict[int, dict[str, Any]]:
    """``epochs`` full epochs per loader; per N: the batches of each epoch and len()."""
    accelerator, model, opt, prepared = _setup(ns, dispatch)
    out: dict[int, dict[str, Any]] = {}
    for n, loader in zip(ns, prepared, strict=True):
        lens, batches = [], []
        for _ in range(epochs):
            lens.append(len(loader))
            batches.append([_step(accelerator, model, opt, b, n) for b in loader])
        out[n] = {"epochs": batches, "lens": lens, "type": type(loader).__name__}
    return out


def train_then_save(
    rank: int, world: int, ns: tuple[int, ...], steps: int, ckpt: str
) -> dict[int, list[list[int]]]:
    """Receive ``steps`` batches of epoch 0 from each loader, then ``save_state``."""
    accelerator, model, opt, prepared = _setup(ns, None)
    out: dict[int, list[list[int]]] = {}
    for n, loader in zip(ns, prepared, strict=True):
        out[n] = []
        for batch in loader:
            out[n].append(_step(accelerator, model, opt, batch, n))
            if len(out[n]) == steps:
                break
    accelerator.save_state(str(Path(ckpt)))
    return out


def load_then_train(
    rank: int, world: int, ns: tuple[int, ...], ckpt: str, skip: int = 0
) -> dict[int, list[list[list[int]]]]:
    """A fresh run: ``load_state``, then two passes: the rest of epoch 0 (with ``skip``,
    through ``accelerator.skip_first_batches(loader, skip)``, Accelerate's documented
    mid-epoch resume), then epoch 1."""
    accelerator, model, opt, prepared = _setup(ns, None)
    accelerator.load_state(str(Path(ckpt)))
    out: dict[int, list[list[list[int]]]] = {}
    for n, loader in zip(ns, prepared, strict=True):
        first = accelerator.skip_first_batches(loader, skip) if skip else loader
        out[n] = [[_step(accelerator, model, opt, b, n) for b in ld] for ld in (first, loader)]
    return out


class Tokenize(torch.utils.data.IterableDataset[Any]):
    """A user's own wrapper over the evenly.Dataset (a tokenizer would go here): holds it
    in an attribute of its own naming and forwards ``__len__`` and ``set_epoch``."""

    def __init__(self, corpus: Any) -> None:
        self.corpus = corpus

    def __len__(self) -> int:
        return len(self.corpus)

    def set_epoch(self, epoch: int) -> None:
        self.corpus.set_epoch(epoch)

    def __iter__(self) -> Any:
        yield from self.corpus


def _epochs(accelerator: Any, model: Any, opt: Any, loader: Any, n: int, epochs: int) -> Any:
    """The batches of each epoch and ``len(loader)`` asked while the pass runs (before
    it, a plain loader's ``len()`` is the dataset's own share: the wrapper has not
    started driving it)."""
    lens, batches = [], []
    for _ in range(epochs):
        epoch, during = [], set()
        for b in loader:
            during.add(len(loader))
            epoch.append(_step(accelerator, model, opt, b, n))
        lens.append(during.pop() if len(during) == 1 else sorted(during))
        batches.append(epoch)
    return {"epochs": batches, "lens": lens}


def boundaries(rank: int, world: int, ns: tuple[int, ...]) -> dict[str, dict[Any, Any]]:
    """A plain DataLoader over evenly handed to prepare(), several configurations in one
    launch (the boundaries issue's Accelerate holes among them).

    - ``dispatch`` / ``shard``, keyed ``(wrapped, n)``: a plain DataLoader over the
      ``evenly.Dataset``, or over the user's ``Tokenize(evenly.Dataset)`` (hole 1),
      prepared with the default dispatcher and with ``dispatch_batches=False``, two
      epochs each;
    - ``after``: an ``evenly.DataLoader`` over the dataset a prepared loader had just run
      (hole 2): ``len(ds)`` and the samples each rank reads;
    - ``stateful``: ``use_stateful_dataloader=True`` over a plain DataLoader (hole 4):
      with workers, the error of the first ``next()``; without, one epoch.
    """
    from accelerate import (  # type: ignore[import-untyped]
        Accelerator,
        DataLoaderConfiguration,
    )

    out: dict[str, dict[Any, Any]] = {k: {} for k in ("dispatch", "shard", "after", "stateful")}
    accelerators = {
        key: Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(**config))
        for key, config in (
            ("dispatch", {}),
            ("shard", {"dispatch_batches": False}),
            ("stateful", {"use_stateful_dataloader": True}),
        )
    }
    model = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt = accelerators["dispatch"].prepare(model, opt)
    for n in ns:
        for key, wrapped in itertools.product(("dispatch", "shard"), (False, True)):
            accelerator = accelerators[key]
            ds = evenly.Dataset(list(range(n)), shuffle=True, seed=0)
            inner = Tokenize(ds) if wrapped else ds
            plain = torch.utils.data.DataLoader(inner, batch_size=BATCH, num_workers=WORKERS)
            loader = accelerator.prepare(plain)
            out[key][wrapped, n] = _epochs(accelerator, model, opt, loader, n, 2)
            if key == "dispatch" and wrapped:
                after = evenly.DataLoader(ds, batch_size=BATCH, num_workers=WORKERS)
                out["after"][n] = {
                    "len_ds": len(ds),
                    "len": len(after),
                    "ids": [int(i) for b in after for i in b.tolist()],
                }
        accelerator = accelerators["stateful"]
        errors = []
        for workers in (WORKERS, 0):
            ds = evenly.Dataset(list(range(n)), shuffle=True, seed=0)
            plain = torch.utils.data.DataLoader(ds, batch_size=BATCH, num_workers=workers)
            loader = accelerator.prepare(plain)
            if workers:
                try:
                    next(iter(loader))
                    errors.append("no error")
                except RuntimeError as e:
                    errors.append(str(e))
                finally:
                    vars(loader)["base_dataloader"]._iterator._shutdown_workers()
            else:
                out["stateful"][n] = _epochs(accelerator, model, opt, loader, n, 1)
        out["stateful"][n]["errors"] = errors
    return out


def _marked(x: int) -> dict[str, Any]:
    return {"id": x, "real": not evenly.is_padding()}


def gather_metrics(rank: int, world: int, ns: tuple[int, ...]) -> dict[Any, Any]:
    """An evaluation loop as Accelerate documents it: ``gather_for_metrics`` of each
    batch's ids, over prepared evenly.DataLoaders (default pad and pad="mask", 2 workers)
    for 2 epochs; per (pad, N): the gathered ids of each epoch, and the EvenlyWarnings."""
    import warnings

    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    out: dict[Any, Any] = {}
    for pad in ("repeat", "mask"):
        for n in ns:
            kw: dict[str, Any] = {"transform": _marked} if pad == "mask" else {}
            ds = evenly.Dataset(list(range(n)), shuffle=True, pad=pad, **kw)
            loader = accelerator.prepare(
                evenly.DataLoader(ds, batch_size=BATCH, num_workers=WORKERS)
            )
            epochs = []
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                for _ in range(2):
                    gathered: list[int] = []
                    for batch in loader:
                        ids = batch["id"] if pad == "mask" else batch
                        gathered += accelerator.gather_for_metrics(ids).tolist()
                    epochs.append(gathered)
            said = [str(w.message) for w in caught if issubclass(w.category, evenly.EvenlyWarning)]
            out[pad, n] = {"epochs": epochs, "warnings": said}
    return out
