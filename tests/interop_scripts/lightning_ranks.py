"""Rank bodies for Lightning: ``Trainer(accelerator="cpu", devices=2, strategy="ddp")`` fitting
a tiny module over an evenly loader, recording the ids and epoch of every training step.

The ranks are started by ``tests.distributed.run_ranks`` (LOCAL_RANK/RANK/WORLD_SIZE set,
gloo group initialised), so Lightning treats them as launched externally, as under torchrun.
"""

from __future__ import annotations

from typing import Any

import torch

import evenly

BATCH, WORKERS = 10, 2


def _module(n: int) -> Any:
    import lightning as L

    class Recorder(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(1, 1)
            self.seen: list[tuple[int, list[int]]] = []

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            self.seen.append((self.current_epoch, [int(i) for i in batch.tolist()]))
            loss: torch.Tensor = self.layer(batch.float().unsqueeze(1) / n).pow(2).mean()
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    return Recorder()


def _trainer(world: int, root: str, **kw: Any) -> Any:
    import lightning as L

    return L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy="ddp" if world > 1 else "auto",
        default_root_dir=root,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **kw,
    )


def _by_epoch(seen: list[tuple[int, list[int]]], epochs: int) -> list[list[list[int]]]:
    return [[ids for e, ids in seen if e == epoch] for epoch in range(epochs)]


def _loader(n: int, plain: bool) -> torch.utils.data.DataLoader[Any]:
    ds = evenly.Dataset(list(range(n)), shuffle=True, seed=0)
    if plain:
        return torch.utils.data.DataLoader(ds, batch_size=BATCH, num_workers=WORKERS)
    return evenly.DataLoader(ds, batch_size=BATCH, num_workers=WORKERS)


def fit(
    rank: int, world: int, ns: tuple[int, ...], root: str, plain: bool
) -> dict[int, list[list[list[int]]]]:
    """Two epochs of ``trainer.fit`` per N, over ``evenly.DataLoader`` or (``plain``) a
    torch DataLoader over ``evenly.Dataset``."""
    out = {}
    for n in ns:
        module = _module(n)
        _trainer(world, f"{root}/n{n}", max_epochs=2).fit(module, _loader(n, plain))
        out[n] = _by_epoch(module.seen, 2)
    return out


def fit_until_checkpoint(
    rank: int, world: int, ns: tuple[int, ...], root: str, steps: int
) -> dict[int, list[list[int]]]:
    """Train ``steps`` batches of epoch 0; ModelCheckpoint saves at that step (mid-epoch)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    out = {}
    for n in ns:
        module = _module(n)
        ckpt = ModelCheckpoint(
            dirpath=f"{root}/n{n}", filename="mid", every_n_train_steps=steps, save_top_k=-1
        )
        trainer = _trainer(world, f"{root}/n{n}", max_epochs=2, max_steps=steps, callbacks=[ckpt])
        trainer.fit(module, _loader(n, plain=False))
        out[n] = [ids for _, ids in module.seen]
    return out


def resume_fit(
    rank: int, world: int, ns: tuple[int, ...], root: str
) -> dict[int, list[list[list[int]]]]:
    """A fresh run: ``fit(ckpt_path=...)`` from the mid-epoch checkpoint to 2 epochs."""
    out = {}
    for n in ns:
        module = _module(n)
        trainer = _trainer(world, f"{root}/n{n}", max_epochs=2)
        trainer.fit(module, _loader(n, plain=False), ckpt_path=f"{root}/n{n}/mid.ckpt")
        out[n] = _by_epoch(module.seen, 2)
    return out


def fit_resume_single(root: str, ns: tuple[int, ...], steps: int) -> dict[str, Any]:
    """One device, no process group: the same checkpoint and resume in one fresh process
    (two Trainers, the second restores from the first one's mid-epoch checkpoint file)."""
    before = fit_until_checkpoint(0, 1, ns, root, steps)
    after = resume_fit(0, 1, ns, root)
    return {"before": before, "after": after}
