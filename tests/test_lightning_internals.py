"""What evenly relies on in Lightning, checked against the installed version
(``constraints.txt`` pins the one CI runs), in this process with one device: no ranks.

- the fit loop calls ``set_epoch`` on the loader's samplers only (``_set_sampler_epoch``:
  ``loader.sampler`` and ``loader.batch_sampler.sampler``), never on its dataset: a plain
  torch DataLoader over ``evenly.Dataset`` advances its epochs by itself;
- with an iterable dataset Lightning does not replace the loader's sampler
  (``use_distributed_sampler`` leaves it alone), so the loader it iterates is the user's;
- a loader with ``state_dict``/``load_state_dict`` (``_Stateful``) is saved in the
  checkpoint, and on ``fit(ckpt_path=...)`` its ``load_state_dict`` runs before Lightning
  reads ``len(loader)`` for ``num_training_batches``; Lightning restores its own batch
  counter and ends the resumed epoch when that counter reaches ``len(loader)``.  So
  ``len()`` after a load must count the batches received before the interruption plus
  those left (the convention ``evenly.DataLoader`` follows, docs/resume.md).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, Sampler

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("lightning") is None, reason="needs lightning (test extra)"
    ),
    pytest.mark.filterwarnings(
        "ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning"
    ),
]

BATCHES, STEPS = 10, 4


class EpochSpy(IterableDataset[int]):
    def __init__(self) -> None:
        self.epochs: list[int] = []

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)

    def __iter__(self) -> Iterator[int]:
        return iter(range(4))


class SamplerSpy(Sampler[int]):
    def __init__(self) -> None:
        self.epochs: list[int] = []

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)

    def __iter__(self) -> Iterator[int]:
        return iter(range(4))

    def __len__(self) -> int:
        return 4


class MapSpy(torch.utils.data.Dataset[int]):
    def __init__(self) -> None:
        self.epochs: list[int] = []

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)

    def __getitem__(self, i: int) -> int:
        return i

    def __len__(self) -> int:
        return 4


def test_the_fit_loop_sets_the_epoch_on_samplers_only() -> None:
    import lightning.pytorch.loops.fit_loop as fit_loop
    from lightning.fabric.utilities.data import _set_sampler_epoch

    assert fit_loop._set_sampler_epoch is _set_sampler_epoch  # what on_advance_start calls
    iterable = EpochSpy()
    _set_sampler_epoch(DataLoader(iterable, batch_size=2), 3)
    assert iterable.epochs == []
    mapped, sampler = MapSpy(), SamplerSpy()
    _set_sampler_epoch(DataLoader(mapped, sampler=sampler, batch_size=2), 5)
    assert sampler.epochs == [5] and mapped.epochs == []


def test_an_iterable_dataset_keeps_its_loader_under_ddp() -> None:
    from lightning.pytorch.trainer.connectors.data_connector import _DataConnector

    connector = _DataConnector.__new__(_DataConnector)
    connector.trainer = SimpleNamespace(
        _accelerator_connector=SimpleNamespace(use_distributed_sampler=True, is_distributed=True)
    )
    assert connector._requires_distributed_sampler(DataLoader(EpochSpy())) is False
    assert connector._requires_distributed_sampler(DataLoader(MapSpy())) is True


class Stateful:
    """A loader of ``BATCHES`` batches that records what Lightning calls.  It ignores the
    state it is given (it yields every batch again), so that what the resumed epoch
    draws is decided by Lightning alone."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.yielded = 0

    def __len__(self) -> int:
        self.calls.append("len")
        return BATCHES

    def __iter__(self) -> Iterator[torch.Tensor]:
        self.calls.append("iter")
        for i in range(BATCHES):
            self.yielded = i + 1
            yield torch.tensor([float(i)])

    def state_dict(self) -> dict[str, Any]:
        return {"yielded": self.yielded}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.calls.append(f"load {state['yielded']}")


def _fit(root: Path, loader: Stateful, **kw: Any) -> list[tuple[int, float]]:
    import lightning as L

    seen: list[tuple[int, float]] = []

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(1, 1)

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            seen.append((self.current_epoch, float(batch[0])))
            loss: torch.Tensor = self.layer(batch.unsqueeze(1)).pow(2).mean()
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    ckpt_path = kw.pop("ckpt_path", None)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        default_root_dir=str(root),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **kw,
    )
    trainer.fit(Module(), loader, ckpt_path=ckpt_path)
    return seen


def test_a_resumed_epoch_ends_when_the_restored_counter_reaches_len(tmp_path: Path) -> None:
    from lightning.fabric.utilities.types import _Stateful
    from lightning.pytorch.callbacks import ModelCheckpoint

    first = Stateful()
    assert isinstance(first, _Stateful)
    ckpt = ModelCheckpoint(
        dirpath=str(tmp_path), filename="mid", every_n_train_steps=STEPS, save_top_k=-1
    )
    before = _fit(tmp_path, first, max_epochs=1, max_steps=STEPS, callbacks=[ckpt])
    assert len(before) == STEPS
    saved = torch.load(tmp_path / "mid.ckpt", weights_only=False)
    loader_states = saved["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    assert len(loader_states) == 1 and set(loader_states[0]) == {"yielded"}

    resumed = Stateful()
    after = _fit(tmp_path, resumed, max_epochs=1, ckpt_path=str(tmp_path / "mid.ckpt"))
    # load_state_dict ran before the len() that sets num_training_batches (and the iter)
    load = resumed.calls.index(f"load {loader_states[0]['yielded']}")
    assert "len" in resumed.calls[load : resumed.calls.index("iter")]
    # the restored counter (STEPS batches) plus what this run drew ends at len(loader)
    assert len(after) == BATCHES - STEPS
