"""Zero-copy hand-off (``transport="slots"``): batches view the workers' shared-memory
slots, and a slot is never written again while the loop holds a batch that views it,
however many it holds, whatever happens to the workers or the loader."""

from __future__ import annotations

import gc
import os
import signal
from typing import Any

import numpy as np
import pytest
import torch

import evenly
from evenly.transport.slots import HOLD

WIDTH = 512


def rows(n: int) -> list[dict[str, Any]]:
    return [{"id": i, "x": np.full(WIDTH, i % 251, dtype=np.uint8)} for i in range(n)]


def intact(batch: dict[str, Any]) -> bool:
    """Every row of ``x`` still holds its own sample's bytes."""
    want = (batch["id"] % 251).to(torch.uint8)[:, None].expand(-1, WIDTH)
    return bool(torch.equal(batch["x"], want))


def loader_over(n: int, **kw: Any) -> evenly.DataLoader:
    ds = evenly.Dataset(rows(n), shuffle=True, seed=3, rank=0, world_size=1)
    return evenly.DataLoader(ds, batch_size=8, num_workers=2, **kw)


@pytest.mark.parametrize("prefetch", [1, 3])
def test_a_held_batch_is_intact_after_reading_k_plus_prefetch_plus_2(prefetch: int) -> None:
    loader = loader_over(8 * 40, prefetch_factor=prefetch)
    transport = None
    it = iter(loader)
    for _ in range(3):
        next(it)
    k = 3
    kept = next(it)
    snapshot = {name: value.clone() for name, value in kept.items()}
    transport = loader._engine.feed.transport
    assert transport is not None and transport.held(k % 2) >= 1  # it views a slot
    for _ in range(k + prefetch + 2 + 2 * prefetch):  # well past the slots' first reuse
        batch = next(it)
        assert intact(batch)
    del batch
    assert all(torch.equal(kept[name], snapshot[name]) for name in kept)
    assert intact(kept)
    rest = [b["id"] for b in it]
    seen = torch.cat([kept["id"], *rest]).tolist()
    assert len(set(seen)) == len(seen)  # nothing handed out twice


def test_a_loop_that_keeps_every_batch_gets_every_batch_right() -> None:
    """More batches held than slots and than ``HOLD`` per worker: the later ones are
    copied, none is overwritten, and the epoch equals torch's hand-off."""
    n = 8 * (4 * HOLD + 3)
    zero_copy = list(loader_over(n))
    plain = list(loader_over(n, transport="torch"))
    assert len(zero_copy) == len(plain) > 2 * 2 * HOLD
    for a, b in zip(zero_copy, plain, strict=True):
        assert torch.equal(a["id"], b["id"]) and torch.equal(a["x"], b["x"])
        assert intact(a)
    assert sorted(torch.cat([b["id"] for b in zero_copy]).tolist()) == list(range(n))


def test_held_batches_outlive_a_killed_worker_and_a_dropped_loader() -> None:
    loader = loader_over(8 * 60, persistent_workers=True)
    it = iter(loader)
    held = [next(it) for _ in range(6)]
    transport = loader._engine.feed.transport
    assert transport is not None and transport.held(0) + transport.held(1) >= 4
    pids = [w.pid for w in it.inner.iterator._workers]  # type: ignore[attr-defined]
    os.kill(pids[0], signal.SIGKILL)
    with pytest.raises(RuntimeError, match="died"):
        for _ in range(60):
            next(it)
    assert all(intact(b) for b in held)
    del it, loader, transport
    gc.collect()
    assert all(intact(b) for b in held)
    held.clear()  # the finalizers run with their transport gone: nothing raised
    gc.collect()


@pytest.mark.parametrize("persistent", [True, False])
def test_a_batch_held_across_epochs_is_intact(persistent: bool) -> None:
    """At a pass start a worker gives every slot still in use a new segment (with
    persistent workers), or new workers get new slots: the held batch is never written."""
    loader = loader_over(8 * 12, persistent_workers=persistent)
    kept = next(iter(loader))
    snapshot = {name: value.clone() for name, value in kept.items()}
    for _ in range(2):
        assert all(intact(b) for b in loader)
    assert all(torch.equal(kept[name], snapshot[name]) for name in kept)
