"""The shared-memory slots batches cross from workers to the main process by:
what comes out equals what the worker made, a slot is never reused while the main
process may still read it, and every loader guarantee holds with them under fork, spawn
and forkserver workers."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import namedtuple
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.utils.data as tud

import evenly
from evenly.transport.slots import RECEIVERS, Packed, Transport, plain_collate, unpack

Pair = namedtuple("Pair", ["left", "right"])


def rich_batch(seed: int, rows: int = 4) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "f32": torch.rand(rows, 3, generator=g),
        "i64": torch.arange(rows) + seed,
        "bool": torch.rand(rows, generator=g) > 0.5,
        "bf16": torch.rand(rows, 2, generator=g).to(torch.bfloat16),
        "empty": torch.zeros(0, 5),
        "np16": np.arange(rows * 2, dtype=np.int16).reshape(rows, 2) + seed,
        "npstr": np.array(["ab", "c", "def", "g"][:rows]),
        "nested": [torch.full((2,), float(seed)), (np.float64(seed), "text", 7)],
        "pair": Pair(torch.ones(rows), np.zeros(rows)),
        "strided": torch.arange(12).reshape(3, 4).t(),  # not contiguous: torch's way
        "grad": torch.ones(2, requires_grad=True),  # requires grad: torch's way
    }


def assert_same(a: Any, b: Any) -> None:
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.detach(), b.detach())
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    else:
        assert a == b


def test_a_packed_batch_unpacks_to_an_equal_batch_in_ordinary_memory() -> None:
    transport = Transport(1, slots=2, hold=0)  # transport="copy"
    writer = transport.writer(0)
    batch = rich_batch(1)
    item = writer.pack(batch)
    assert type(item) is Packed and item.arena is not None
    out = unpack(item)
    assert_same(out, batch)
    assert out["f32"].untyped_storage().data_ptr() != item.arena.data_ptr()  # a copy
    assert transport.held(0) == 0  # copied out: the slot is free at once
    assert out["strided"].stride() == batch["strided"].stride()  # left to torch as it was


def test_a_zero_copy_batch_views_its_slot_until_its_last_view_is_freed() -> None:
    transport = Transport(1, slots=2)
    writer = transport.writer(0)
    batch = rich_batch(1)
    item = writer.pack(batch)
    out = unpack(item)
    assert_same(out, batch)
    assert out["f32"].data_ptr() == item.arena.data_ptr()  # the slot's own memory
    assert transport.held(0) == 1
    keep = out["np16"][1:]  # a view of a view keeps the slot
    del out
    assert transport.held(0) == 1
    writer.drain()
    assert writer.busy == {item.slot: item.ticket}
    del keep
    assert transport.held(0) == 0
    writer.drain()
    assert writer.busy == {}


def test_a_slot_is_reused_only_after_the_main_process_copied_it_out() -> None:
    transport = Transport(1, slots=2, hold=0)
    writer = transport.writer(0)
    first, second = writer.pack(rich_batch(1)), writer.pack(rich_batch(2))
    assert {first.slot, second.slot} == {0, 1}
    # both slots in use: the next batch goes torch's way, unchanged
    third = rich_batch(3)
    assert writer.pack(third) is third
    assert_same(unpack(first), rich_batch(1))
    fourth = writer.pack(rich_batch(4))  # the freed slot
    assert type(fourth) is Packed and fourth.slot == first.slot
    assert fourth.arena is None  # the main process has the segment since the first batch
    assert_same(unpack(second), rich_batch(2))
    assert_same(unpack(fourth), rich_batch(4))


def test_a_loop_holding_batches_gets_more_slots_up_to_a_bound_then_copies() -> None:
    """Slots never block: with every slot held by the loop the worker adds one, up to
    ``slots + hold``; the main process copies once the loop holds ``hold`` batches (so
    their slots come back at once), and past the bound a batch goes torch's way."""
    transport = Transport(1, slots=2, hold=3)
    writer = transport.writer(0)
    held = [unpack(writer.pack(rich_batch(i))) for i in range(3)]  # zero-copy, held
    assert transport.held(0) == 3 and len(writer.segments) == 3
    copied = unpack(writer.pack(rich_batch(3)))  # the loop holds 3: copied, slot freed
    assert transport.held(0) == 3
    writer.drain()
    assert len(writer.busy) == 3
    in_flight = [writer.pack(rich_batch(i)) for i in (4, 5)]  # slots 4 and 5 of 5
    assert all(type(p) is Packed for p in in_flight) and len(writer.segments) == 5
    over = rich_batch(6)
    assert writer.pack(over) is over  # the bound: torch's way, no wait
    for i, out in enumerate([*held, copied, *map(unpack, in_flight)]):
        assert_same(out, rich_batch(i))


def test_a_late_free_message_never_frees_a_slot_that_was_reused() -> None:
    """A slot still in use at a pass start gets a new segment (the loop may hold the old
    one, or it carried a batch the abandoned pass dropped): a free message for the old
    use frees nothing and the old memory is never written again."""
    transport = Transport(1, slots=1, hold=0)
    writer = transport.writer(0)
    assert writer.free is not None
    dropped = writer.pack(rich_batch(1))  # a batch an abandoned pass never handed over
    old = dropped.arena.clone()
    writer.reclaim()  # the next pass starts
    current = writer.pack(rich_batch(2))
    assert current.slot == dropped.slot and current.key != dropped.key
    assert current.arena is not None and current.arena.data_ptr() != dropped.arena.data_ptr()
    assert torch.equal(dropped.arena, old)  # the retired segment was not written
    transport._send_free(dropped)  # a free message for the old use of the slot
    assert writer.free.poll()  # it waits in the worker's pipe
    third = rich_batch(3)
    assert writer.pack(third) is third  # the one slot is still busy: torch's hand-off
    assert not writer.free.poll()  # the late message was read ...
    assert writer.busy == {current.slot: current.ticket}  # ... and it freed nothing
    assert_same(unpack(current), rich_batch(2))  # the reused slot's batch is intact
    fourth = writer.pack(rich_batch(4))  # the current batch's own message frees the slot
    assert type(fourth) is Packed and fourth.slot == current.slot
    assert fourth.arena is None  # sent without the segment: the main process has it
    assert_same(unpack(fourth), rich_batch(4))


def test_a_bigger_batch_gets_a_bigger_arena_that_the_main_process_learns() -> None:
    transport = Transport(1, slots=2)
    writer = transport.writer(0)
    small = writer.pack({"x": torch.ones(4)})
    assert_same(unpack(small), {"x": torch.ones(4)})
    big = {"x": torch.arange(100_000, dtype=torch.float64)}
    item = writer.pack(big)
    assert item.key != small.key and item.arena is not None
    assert_same(unpack(item), big)


def test_plain_collate_equals_default_collate_outside_shared_memory() -> None:
    samples = [
        {"a": np.arange(3) + i, "b": float(i), "c": (torch.ones(2) * i, "s")} for i in range(5)
    ]
    assert_same(plain_collate(samples), tud.default_collate(samples))


def test_the_pin_memory_thread_unpacks_before_pinning(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.utils.data._utils.pin_memory as pinning

    pinned: list[Any] = []

    def pin(data: Any, device: Any = None) -> Any:  # CPU-only torch cannot pin
        pinned.append(data)
        return data

    monkeypatch.setattr(pinning, "pin_memory", pin)
    transport = Transport(1, slots=1)
    item = transport.writer(0).pack({"x": torch.arange(5)})
    out = item.pin_memory()
    assert_same(out, {"x": torch.arange(5)})
    assert pinned == [out]


def test_a_batch_that_crossed_a_queue_finds_its_transport_by_id_alone() -> None:
    """Why a per-process registry (``RECEIVERS``): a packed batch arrives pickled, naming
    its transport by id only, and is unpacked where nothing else is at hand (torch's
    pin-memory thread).  The registry is weak: a dropped loader's batch raises clearly."""
    import gc
    import pickle

    transport = Transport(1, slots=1)
    item = pickle.loads(pickle.dumps(transport.writer(0).pack({"x": torch.arange(3)})))
    assert type(item) is Packed and item.owner == transport.id
    assert RECEIVERS.find(transport.id) is transport
    assert_same(unpack(item), {"x": torch.arange(3)})

    late = pickle.loads(pickle.dumps(transport.writer(0).pack({"x": torch.arange(4)})))
    owner = transport.id
    del transport
    gc.collect()
    assert RECEIVERS.find(owner) is None
    with pytest.raises(RuntimeError, match="from workers of a loader that is gone"):
        unpack(late)


def rows_source(n: int) -> list[dict[str, Any]]:
    return [{"id": i, "x": np.full(3, i, dtype=np.int16), "y": float(i)} for i in range(n)]


@pytest.mark.parametrize("context", ["fork", "spawn", "forkserver"])
def test_slots_give_the_same_batches_as_torchs_hand_off(context: str) -> None:
    def epochs(transport: str) -> list[list[dict[str, Any]]]:
        ds = evenly.Dataset(rows_source(203), shuffle=True, seed=5, rank=0, world_size=1)
        loader = evenly.DataLoader(
            ds,
            batch_size=16,
            num_workers=2,
            transport=transport,
            multiprocessing_context=context,
        )
        return [list(loader) for _ in range(2)]

    slots, plain = epochs("slots"), epochs("torch")
    for epoch_slots, epoch_plain in zip(slots, plain, strict=True):
        assert_same(epoch_slots, epoch_plain)
        ids = torch.cat([b["id"] for b in epoch_slots]).tolist()
        assert sorted(ids) == list(range(203))  # exactly once
        assert all(bool((b["x"][:, 0] == b["id"]).all()) for b in epoch_slots)
    # the slots were used: their batches view evenly's slots, not torch's shared segments
    assert not any(b["x"].is_shared() for e in slots for b in e)
    assert all(b["x"].is_shared() for e in plain for b in e)


def test_an_abandoned_pass_and_a_worker_restart_keep_every_epoch_exact() -> None:
    ds = evenly.Dataset(rows_source(300), shuffle=True, seed=2, rank=0, world_size=1)
    loader = evenly.DataLoader(ds, batch_size=8, num_workers=2, prefetch_factor=4)
    it = iter(loader)
    for _ in range(3):  # stop early: prefetched batches hold slots that are never freed
        next(it)
    for epoch in range(1, 3):
        slots = loader._engine.feed.transport
        if epoch == 2:  # a new source restarts the workers with new slots
            ds.source = rows_source(300)  # a new object: new workers
        ids = [i for b in loader for i in b["id"].tolist()]
        assert sorted(ids) == list(range(len(ds.source))), epoch
        assert (loader._engine.feed.transport is slots) == (epoch == 1)


def test_an_unknown_transport_is_refused() -> None:
    with pytest.raises(ValueError, match="transport must be"):
        evenly.DataLoader(evenly.Dataset(list(range(4))), transport="pipes")


def test_a_copy_made_outside_a_worker_start_has_no_slots() -> None:
    import pickle

    copy = pickle.loads(pickle.dumps(Transport(2, slots=2)))
    batch = {"x": torch.ones(3)}
    assert copy.writer(1).pack(batch) is batch  # torch's hand-off, nothing shared


def test_no_slots_when_shared_memory_is_short(monkeypatch: pytest.MonkeyPatch) -> None:
    import evenly.transport.slots as transport_module

    monkeypatch.setattr(transport_module, "_shm_free", lambda: 1 << 20)
    writer = Transport(1, slots=3).writer(0)
    batch = {"x": torch.zeros(1 << 18)}  # 1 MiB: three slots would take most of it
    assert writer.pack(batch) is batch and writer.disabled


def _in_short_shm(mib: int) -> list[str] | None:
    """The command running tests/scripts/short_shm.py under a /dev/shm of ``mib`` MiB of
    its own (a private mount namespace), or None where this user cannot make one."""
    probe = subprocess.run(
        ["unshare", "--mount", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /dev/shm"],
        capture_output=True,
        check=False,
    )
    if probe.returncode != 0:
        return None
    root = Path(__file__).resolve().parents[1]
    script = root / "tests" / "scripts" / "short_shm.py"
    run = f"mount -t tmpfs -o size={mib}m tmpfs /dev/shm && exec {sys.executable} {script}"
    return ["unshare", "--mount", "sh", "-c", run]


@pytest.mark.slow
def test_a_short_dev_shm_is_a_clear_error_not_a_hang() -> None:
    """A real 12 MiB /dev/shm: batches too big for the slots go torch's way and cannot
    all fit either; the worker moves them into shared memory itself, so the shortage is
    evenly's error in the main process, never a batch dropped by torch's queue thread
    while the loop waits forever."""
    command = _in_short_shm(12)
    if command is None:
        pytest.skip("needs a private mount namespace (unshare --mount, as root)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert "evenly: no room in shared memory (/dev/shm" in proc.stderr
    assert "--shm-size" in proc.stderr


def _aliased_and_nested(index: int) -> dict[str, Any]:
    t = torch.full((3,), float(index))
    return {"a": t, "b": t, "n": torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])}


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning")
@pytest.mark.parametrize("transport", ["slots", "copy", "torch"])
def test_aliased_and_nested_tensors_arrive_as_torch_hands_them_over(transport: str) -> None:
    """A tensor that appears twice in a batch arrives as one tensor, and a strided nested
    tensor goes through (both as with torch's own hand-off)."""
    data = [_aliased_and_nested(i) for i in range(8)]
    ds = evenly.Dataset(data)
    loader = evenly.DataLoader(
        ds, batch_size=None, num_workers=2, transport=transport, collate_fn=lambda x: x
    )
    got = list(loader)
    assert len(got) == 8
    for item in got:
        assert item["a"] is item["b"]
        assert item["n"].is_nested and [t.numel() for t in item["n"].unbind()] == [2, 3]
