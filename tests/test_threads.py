"""The thread read path (``worker_type="thread"``): the same batches in the same order
as worker processes for every source format and shuffle mode, exact resume, chosen by
``"auto"`` only where it is safe, refused where per-sample seeding makes it unsafe."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import torch

import evenly

N, SHARD, BATCH = 203, 25, 8
FORMATS = ["memory", "arrow", "parquet", "jsonl", "webdataset"]


def sample(i: int) -> dict[str, Any]:
    return {"id": i, "v": float(i) / 2}


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("threads")
    dirs = {}
    for fmt in FORMATS[1:]:
        out = root / fmt
        evenly.write((sample(i) for i in range(N)), out, fmt, SHARD, progress=False)
        dirs[fmt] = str(out)
    columns = pa.schema([("id", pa.int64()), ("data", pa.list_(pa.uint8(), 16))])
    rows = ({"id": i, "data": np.full(16, i % 256, np.uint8)} for i in range(N))
    evenly.write(rows, root / "columns", "arrow", SHARD, schema=columns, progress=False)
    dirs["columns"] = str(root / "columns")
    return dirs


def open_source(fmt: str, dirs: dict[str, str]) -> Any:
    if fmt == "memory":
        return [sample(i) for i in range(N)]
    if fmt == "webdataset":
        return evenly.from_webdataset(dirs[fmt])
    return getattr(evenly, f"from_{fmt}")(dirs[fmt])


def decoded(batch: Any) -> Any:
    """A batch as plain values (tar fields arrive as JSON bytes)."""
    if isinstance(batch, dict):
        return {k: decoded(v) for k, v in batch.items() if not k.startswith("__")}
    if isinstance(batch, torch.Tensor):
        return batch.tolist()
    if isinstance(batch, list):
        return [decoded(v) for v in batch]
    return json.loads(batch) if isinstance(batch, bytes) else batch


def epochs(fmt: str, shuffle: str, dirs: dict[str, str], worker_type: str) -> list[Any]:
    ds = evenly.Dataset(open_source(fmt, dirs), shuffle=shuffle, seed=4, rank=0, world_size=1)
    collate = None if fmt != "webdataset" else (lambda b: b)
    loader = evenly.DataLoader(
        ds, batch_size=BATCH, num_workers=3, worker_type=worker_type, collate_fn=collate
    )
    return [[decoded(b) for b in loader] for _ in range(2)]


CASES = [
    (f, s)
    for f in FORMATS
    for s in ("global", "block", "none")
    if not (f == "memory" and s == "block")
]


@pytest.mark.parametrize(("fmt", "shuffle"), CASES)
def test_threads_give_the_batches_of_processes_in_their_order(
    fmt: str, shuffle: str, sources: dict[str, str]
) -> None:
    threads = epochs(fmt, shuffle, sources, "thread")
    processes = epochs(fmt, shuffle, sources, "process")
    assert threads == processes
    for epoch in threads:
        ids = [i for b in epoch for i in (b["id"] if isinstance(b, dict) else _ids(b))]
        assert sorted(ids) == list(range(N))  # exactly once
    assert threads[0] != threads[1] or shuffle == "none"


def _ids(samples: list[dict[str, Any]]) -> list[int]:
    return [int(s["id"]) for s in samples]


@pytest.mark.parametrize("shuffle", ["global", "block", "none"])
def test_columnar_arrow_auto_reads_in_threads_and_equals_processes(
    shuffle: str, sources: dict[str, str]
) -> None:
    def run(worker_type: str) -> tuple[list[Any], bool]:
        ds = evenly.Dataset(evenly.from_arrow(sources["columns"]), shuffle=shuffle, seed=1)
        loader = evenly.DataLoader(ds, batch_size=BATCH, num_workers=2, worker_type=worker_type)
        batches = [decoded(b) for b in loader]
        return batches, type(iter(loader).inner).__name__ == "ThreadPass"

    (auto, in_threads), (processes, in_procs) = run("auto"), run("process")
    assert in_threads and not in_procs
    assert auto == processes
    assert all(
        row == [i % 256] * 16 for b in auto for i, row in zip(b["id"], b["data"], strict=True)
    )


def test_auto_keeps_processes_for_per_sample_reads_and_seeded_transforms() -> None:
    def kind(ds: evenly.Dataset[Any], **kw: Any) -> str:
        loader = evenly.DataLoader(ds, batch_size=4, num_workers=2, **kw)
        return type(iter(loader).inner).__name__

    assert kind(evenly.Dataset(list(range(20)))) != "ThreadPass"  # per-sample Python
    seeded = evenly.Dataset(list(range(20)), transform=lambda x: x + 1)
    with pytest.raises(ValueError, match=r"seed_generators=\(\).*sample_seed"):
        kind(seeded, worker_type="thread")
    unseeded = evenly.Dataset(list(range(20)), transform=lambda x: x + 1, seed_generators=())
    assert kind(unseeded, worker_type="thread") == "ThreadPass"
    with pytest.raises(ValueError, match="worker_init_fn"):
        kind(unseeded, worker_type="thread", worker_init_fn=print)
    with pytest.raises(ValueError, match="worker_type must be one of"):
        kind(unseeded, worker_type="threads")


def test_a_transform_with_sample_seed_draws_the_same_in_threads_as_in_processes() -> None:
    def augment(x: int) -> tuple[int, int]:
        rng = np.random.default_rng(evenly.sample_seed())
        return x, int(rng.integers(1 << 30))

    def run(worker_type: str) -> list[Any]:
        ds = evenly.Dataset(list(range(60)), transform=augment, seed_generators=(), seed=2)
        loader = evenly.DataLoader(ds, batch_size=5, num_workers=3, worker_type=worker_type)
        return [[t.tolist() for t in b] for b in loader]

    assert run("thread") == run("process")


def test_a_reader_error_is_raised_in_the_loop_naming_the_sample() -> None:
    class Broken:
        def __len__(self) -> int:
            return 40

        def __getitem__(self, i: int) -> int:
            if i == 17:
                raise ValueError("bad row 17")
            return i

    earlier = set(threading.enumerate())  # an earlier test's readers may still be ending
    ds = evenly.Dataset(Broken(), shuffle=False)
    loader = evenly.DataLoader(ds, batch_size=4, num_workers=2, worker_type="thread")
    with pytest.raises(ValueError, match="bad row 17") as info:
        list(loader)
    assert "sample 17" in "".join(getattr(info.value, "__notes__", []))
    mine = [t for t in threading.enumerate() if t.name.startswith("evenly-reader")]
    for thread in (t for t in mine if t not in earlier):  # told to stop: they end
        thread.join(timeout=60)  # a margin a busy machine keeps; a stuck reader fails
        assert not thread.is_alive(), thread


def test_an_abandoned_thread_pass_stops_its_readers_and_resumes_exactly(
    sources: dict[str, str],
) -> None:
    def loader() -> evenly.DataLoader:
        ds = evenly.Dataset(evenly.from_parquet(sources["parquet"]), shuffle=True, seed=9)
        return evenly.DataLoader(ds, batch_size=BATCH, num_workers=2, worker_type="thread")

    first = loader()
    it = iter(first)
    head = [next(it)["id"].tolist() for _ in range(7)]
    state = first.state_dict()
    rest_of_epoch = [b["id"].tolist() for b in first]  # a new pass: epoch 1
    assert not [t for t in threading.enumerate() if t.name.startswith("evenly-reader")]
    resumed = loader()
    resumed.load_state_dict(state)
    tail = [b["id"].tolist() for b in resumed]
    ids = [i for b in head + tail for i in b]
    assert sorted(ids) == list(range(N))
    fresh = [b["id"].tolist() for b in loader()]
    assert head + tail == fresh
    assert rest_of_epoch != fresh  # the loader moved on to epoch 1


def test_thread_copies_of_file_sources_are_their_own(tmp_path: Path) -> None:
    evenly.write((sample(i) for i in range(30)), tmp_path, "parquet", 10, progress=False)
    source = evenly.from_parquet(tmp_path)
    source[3]  # opens a file in this copy
    twin = source.copy_for_thread()
    assert twin is not source and twin._handles is not source._handles and not twin._handles
    assert twin[3] == source[3]
    mix = evenly.Mix({"a": source, "b": list(range(5))})
    twin_mix = mix.copy_for_thread()
    assert twin_mix._sources[0] is not source and twin_mix._sources[1] is mix._sources[1]


def test_single_samples_and_a_collate_fn_go_through_threads_as_through_processes() -> None:
    def run(worker_type: str, **kw: Any) -> list[Any]:
        ds = evenly.Dataset([sample(i) for i in range(30)], shuffle=True, seed=3)
        loader = evenly.DataLoader(ds, num_workers=2, worker_type=worker_type, **kw)
        return [decoded(b) for b in loader]

    assert run("thread", batch_size=None) == run("process", batch_size=None)
    pairs = {"batch_size": 4, "collate_fn": lambda b: [s["id"] for s in b]}
    assert run("thread", **pairs) == run("process", **pairs)


@pytest.mark.parametrize("batch_size", [BATCH, None])
@pytest.mark.parametrize("fmt", ["columns", "parquet"])
def test_a_thread_pass_reports_the_stage_times_a_process_pass_does(
    fmt: str, batch_size: int | None, sources: dict[str, str]
) -> None:
    """Each batch of a reader thread carries its own stage times to ``loader.stats()``,
    as a worker process's does (a columnar pass, a per-sample one, single samples)."""

    def run(worker_type: str) -> tuple[list[Any], evenly.EpochStats | None]:
        source = getattr(evenly, f"from_{'arrow' if fmt == 'columns' else fmt}")(sources[fmt])
        ds = evenly.Dataset(source, shuffle=True, seed=2)
        loader = evenly.DataLoader(
            ds, batch_size=batch_size, num_workers=2, worker_type=worker_type
        )
        return [decoded(b) for b in loader], loader.stats().last

    (threads, t), (processes, p) = run("thread"), run("process")
    assert threads == processes
    assert t is not None and p is not None
    assert (t.batches, t.samples, t.finished) == (p.batches, p.samples, True)
    assert t.samples == N and t.read_seconds > 0 and p.read_seconds > 0


_EXIT_MID_READ = """
import sys, evenly
ds = evenly.Dataset(evenly.from_arrow(sys.argv[1]), shuffle=True)
it = iter(evenly.DataLoader(ds, batch_size=512, num_workers=2, worker_type="thread"))
next(it)  # the interpreter exits while both readers are gathering the batches ahead
"""


def test_the_process_exits_cleanly_while_its_reader_threads_are_reading(tmp_path: Path) -> None:
    # a daemon reader still inside torch's C++ when the interpreter finalizes is killed
    # there: the process aborts ("terminate called without an active exception"); it
    # did so in about half of such exits before the readers were stopped at exit
    schema = pa.schema([("idx", pa.int64()), ("data", pa.list_(pa.uint8(), 4096))])
    rows = ({"idx": i, "data": np.full(4096, i % 251, np.uint8)} for i in range(16000))
    evenly.write(rows, tmp_path, "arrow", 2000, schema=schema, progress=False)
    runs = [
        subprocess.Popen(
            [sys.executable, "-c", _EXIT_MID_READ, str(tmp_path)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(8)
    ]
    ended = [(run.communicate(timeout=300)[1], run.returncode) for run in runs]
    for err, code in ended:
        assert code == 0 and "terminate" not in err, (code, err[-2000:])


def test_held_columnar_batches_are_never_overwritten_by_recycled_buffers(
    tmp_path: Path,
) -> None:
    # reader threads gather columnar Arrow groups into buffers they reuse once nothing
    # views them: a batch (or a slice of one) the loop keeps must keep its rows
    width, n, batch = 64, 6000, 50
    schema = pa.schema([("idx", pa.int64()), ("data", pa.list_(pa.uint8(), width))])
    rows = ({"idx": i, "data": np.full(width, i % 251, np.uint8)} for i in range(n))
    evenly.write(rows, tmp_path, "arrow", 700, schema=schema, progress=False)
    ds = evenly.Dataset(evenly.from_arrow(tmp_path), shuffle=True, seed=5)
    loader = evenly.DataLoader(ds, batch_size=batch, num_workers=2, worker_type="thread")

    def intact(ids: torch.Tensor, data: torch.Tensor) -> bool:
        return bool(torch.equal(data, (ids % 251).to(torch.uint8)[:, None].expand(-1, width)))

    for _ in range(2):  # the second epoch reads into the buffers the first gave back
        kept, slices, seen = [], [], []
        for k, b in enumerate(loader):
            assert intact(b["idx"], b["data"])
            seen.append(b["idx"].clone())
            if k % 7 == 0:
                kept.append(b)
            if k % 11 == 0:
                slices.append((b["idx"][3:9], b["data"][3:9]))
            del b
        assert all(intact(b["idx"], b["data"]) for b in kept)
        assert all(intact(ids, data) for ids, data in slices)
        assert sorted(torch.cat(seen).tolist()) == list(range(n))
