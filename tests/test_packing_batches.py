"""Packed batches built a batch at a time: the vectorised assembly equals a token-by-token
reference, concat locates any set of rows as row by row, reader threads give the batches
worker processes give (and are what ``worker_type="auto"`` picks for a token-reading
source without a transform, and only then), a resume lands inside a read group exactly, a
replaced source is packed in its own order, and the pad token and planned-length checks
still name the document.

Documents hold tokens that name them: document ``i``'s token ``t`` is ``1000 * (i + 1) + t``.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import warnings
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import evenly
from evenly.core.packing.concat import ConcatRows, concat_checkpoints
from evenly.core.packing.pieces import IGNORE, PIECE, piece_tokens, place
from evenly.dataset import planner_of
from evenly.runtime.packer import PackedRows
from evenly.sources._tokens import TokenSpan

pytestmark = pytest.mark.filterwarnings("ignore:evenly.*pad row:evenly.EvenlyWarning")
SEQ = 16
LENGTHS = [int(n) for n in np.random.default_rng(11).integers(1, 45, size=150)]


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EVENLY_CACHE_DIR", str(tmp_path / "cache"))


def _docs(lengths: list[int] = LENGTHS) -> list[list[int]]:
    return [[1000 * (i + 1) + t for t in range(n)] for i, n in enumerate(lengths)]


def _arrow(tmp_path: Any, docs: list[list[int]]) -> Any:
    path = tmp_path / "docs.arrow"
    table = pa.table({"input_ids": pa.array(docs, type=pa.list_(pa.int32()))})
    with pa.ipc.new_file(str(path), table.schema) as writer:
        for lo in range(0, table.num_rows, 40):  # several record batches
            writer.write_table(table.slice(lo, 40))
    return evenly.from_arrow(str(path))


def _concat(lengths: np.ndarray, seq_len: int, stride: int) -> ConcatRows:
    at = lambda p: lengths[p]  # noqa: E731
    cum = concat_checkpoints(at, lengths.size, stride=stride, chunk=stride * 2)
    return ConcatRows(cum, at, lengths.size, seq_len=seq_len, stride=stride)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(0, 30), min_size=1, max_size=80),
    st.integers(1, 13),
    st.integers(1, 5),
    st.data(),
)
def test_concat_pieces_of_any_rows_equal_those_located_row_by_row(lengths, seq_len, stride, data):
    arr = np.array(lengths, dtype=np.int64)
    table = _concat(arr, seq_len, stride)
    if table.num_rows == 0:
        return
    rows = data.draw(st.sets(st.integers(0, table.num_rows - 1), min_size=1))
    wanted = np.array(sorted(rows), dtype=np.int64)
    one_by_one = np.concatenate(
        [_concat(arr, seq_len, stride).pieces(wanted[i : i + 1]) for i in range(wanted.size)]
    )
    got = table.pieces(wanted[::-1])  # any order asked: sorted by row, then position
    assert got.tolist() == one_by_one.tolist()


def _reference_rows(rows, pieces, tokens, seq_len, pad_id, doc_index):
    """Token by token: each row's pieces one after the other, then pads."""
    out = {k: [] for k in ("input_ids", "position_ids", "labels", "document_ids")}
    for r in rows:
        ids, pos, doc = [], [], []
        for p in pieces[pieces["row"] == r]:
            for i in range(int(p["len"])):
                ids.append(int(tokens[int(p["pos"])][int(p["start"]) + i]))
                pos.append(i)
                doc.append(doc_index[int(p["pos"])] + 1)
        pad = seq_len - len(ids)
        out["input_ids"].append(ids + [pad_id] * pad)
        out["position_ids"].append(pos + [0] * pad)
        labels = [IGNORE if q == 0 else t for t, q in zip(ids, pos, strict=True)]
        out["labels"].append(labels + [IGNORE] * pad)
        out["document_ids"].append(doc + [0] * pad)
    return out


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(1, 6), max_size=4), min_size=1, max_size=6), st.data())
def test_place_equals_a_token_by_token_reference(layout, data):
    """Rows of pieces (lengths per row; an empty list is a pad row), seq_len of the
    longest row or more: short rows, full rows and pad rows side by side."""
    seq_len = max(sum(r) for r in layout) + data.draw(st.integers(0, 3)) or 1
    base = data.draw(st.integers(0, 5))
    rows = np.arange(base, base + len(layout), dtype=np.int64)
    cols: list[tuple[int, int, int, int]] = []
    tokens: dict[int, np.ndarray] = {}
    for r, lens in zip(rows.tolist(), layout, strict=True):
        for n in lens:
            pos = len(tokens)
            start = data.draw(st.integers(0, 3))
            tokens[pos] = np.arange(start + n, dtype=np.int32) + 1000 * (pos + 1)
            cols.append((r, pos, start, n))
    pieces = np.array(cols, dtype=PIECE)
    doc_index = {p: 7 * p + 2 for p in tokens}
    index = np.array([doc_index[p] for p in pieces["pos"].tolist()], dtype=np.int64)
    flat = piece_tokens(pieces, tokens)
    got = place(rows, pieces, flat, seq_len=seq_len, pad_id=0, doc_index=index)
    want = _reference_rows(rows.tolist(), pieces, tokens, seq_len, 0, doc_index)
    assert list(got) == ["input_ids", "position_ids", "labels", "document_ids"]
    assert {k: v.tolist() for k, v in got.items()} == want
    assert all(v.dtype == np.int64 and v.shape == (len(layout), seq_len) for v in got.values())


def _batches(loader: Any) -> list[dict[str, Any]]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", evenly.EvenlyWarning)
        return [
            {k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in b.items()}
            for b in loader
        ]


def test_reader_threads_give_the_batches_of_worker_processes_and_auto_picks_them(tmp_path):
    source = _arrow(tmp_path, _docs())
    pack = evenly.Packing(SEQ, document_ids=True, cu_seqlens=True)
    ds = evenly.Dataset(source, shuffle=True, seed=5, pack=pack)
    seen: list[tuple[bool, int]] = []

    class Watch:
        """Sees, at each batch, whether reader threads run and how many child processes."""

        def __init__(self, loader: Any) -> None:
            self.loader = loader

        def __iter__(self) -> Any:
            for batch in self.loader:
                names = [t.name for t in threading.enumerate()]
                seen.append(
                    (
                        any(n.startswith("evenly-reader") for n in names),
                        len(multiprocessing.active_children()),
                    )
                )
                yield batch

    auto = _batches(Watch(evenly.DataLoader(ds, batch_size=3, num_workers=2)))
    assert seen[0][0] and all(children == 0 for _, children in seen)  # readers finish early
    fork = _batches(evenly.DataLoader(ds, batch_size=3, num_workers=2, worker_type="process"))
    spawn = _batches(
        evenly.DataLoader(
            ds, batch_size=3, num_workers=2, worker_type="process", multiprocessing_context="spawn"
        )
    )
    plain = _batches(evenly.DataLoader(ds, batch_size=3))
    assert auto == fork == spawn
    # the rows are those of one process (the order of batches differs: dealt to workers)
    key = lambda b: b["input_ids"]  # noqa: E731
    assert sorted(auto, key=key) == sorted(plain, key=key)
    tokens = sorted(t for b in auto for row in b["input_ids"] for t in row if t)
    assert tokens == sorted(t for d in _docs() for t in d)  # every token once
    for b in auto:  # cu_seqlens: where position_ids is 0, then the end
        flat = np.array(b["position_ids"]).reshape(-1)
        assert b["cu_seqlens"] == [*np.flatnonzero(flat == 0).tolist(), flat.size]


def _ords(texts: list[str]) -> list[list[int]]:
    return [[ord(c) for c in text] for text in texts]


def test_auto_reads_a_tokenizing_pass_over_a_columnar_source_in_worker_processes(tmp_path):
    # Parquet text columns can be read as columns (read_columns equals default_collate),
    # but a packed pass never reads columns: it tokenizes each document in Python, so
    # "auto" keeps worker processes (a packed pass in threads is read by one thread)
    texts = [f"doc{i}:" + "x" * (i % 23) for i in range(60)]
    evenly.write(({"text": t} for t in texts), tmp_path / "text", "parquet", 20, progress=False)
    source = evenly.from_parquet(str(tmp_path / "text"))
    assert source.columnar_exact
    pack = evenly.Packing(SEQ, tokenize=_ords, tokenizer_id="ord-v1", field="text", pad_id=0)
    ds = evenly.Dataset(source, shuffle=True, seed=6, pack=pack)

    def run(worker_type: str) -> tuple[list[dict[str, Any]], str]:
        loader = evenly.DataLoader(ds, batch_size=3, num_workers=2, worker_type=worker_type)
        return _batches(loader), type(iter(loader).inner).__name__

    (auto, auto_kind), (procs, _) = run("auto"), run("process")
    assert auto_kind != "ThreadPass"
    assert auto == procs
    tokens = sorted(t for b in auto for row in b["input_ids"] for t in row if t)
    assert tokens == sorted(t for ids in _ords(texts) for t in ids)  # every token once


def test_a_custom_collate_gets_the_rows_of_the_default_batches(tmp_path):
    ds = evenly.Dataset(_arrow(tmp_path, _docs()), shuffle=True, seed=5, pack=evenly.Packing(SEQ))
    got: list[list[dict[str, torch.Tensor]]] = []

    def collate(rows: list[dict[str, torch.Tensor]]) -> int:
        got.append(rows)
        return len(rows)

    sizes = list(evenly.DataLoader(ds, batch_size=4, collate_fn=collate))
    default = _batches(evenly.DataLoader(ds, batch_size=4))
    assert sizes == [4] * len(default)
    for rows, batch in zip(got, default, strict=True):
        assert all(r["input_ids"].shape == (SEQ,) for r in rows)
        for key, value in batch.items():
            assert [r[key].tolist() for r in rows] == value


@pytest.mark.parametrize("worker_type", ["thread", "process"])
def test_a_resume_inside_a_read_group_continues_exactly(tmp_path, worker_type):
    """Rows are read in groups of batches (1, 2, 4, ... per read): a state saved after 8
    batches of 3 (row 24, inside the fourth read of one reader thread and the third of
    each worker process) resumes under 1 worker and batches of 5 with the rows the
    uninterrupted run had left."""
    ds = evenly.Dataset(_arrow(tmp_path, _docs()), shuffle=True, seed=2, pack=evenly.Packing(SEQ))
    loader = evenly.DataLoader(ds, batch_size=3, num_workers=2, worker_type=worker_type)
    whole = [row for b in _batches(loader) for row in b["input_ids"]]
    loader = evenly.DataLoader(ds, batch_size=3, num_workers=2, worker_type=worker_type)
    it = iter(loader)  # the same epoch 0, interrupted
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", evenly.EvenlyWarning)
        before = [row for _ in range(8) for row in next(it)["input_ids"].tolist()]
    state = loader.state_dict()
    del it
    other = evenly.DataLoader(ds, batch_size=5, num_workers=1, worker_type=worker_type)
    other.load_state_dict(state)
    after = [row for b in _batches(other) for row in b["input_ids"]]
    real = [r for r in whole if any(r)]
    assert before + [r for r in after if any(r)] == real


def test_a_worker_restored_inside_a_read_group_skips_exactly_its_rows(tmp_path):
    """A restored worker skips ``skip`` rows of its share (rows are read in groups of
    whole batches): what it yields is its share from row ``skip`` on, for any skip."""
    from evenly.core.spec import PassSpec

    ds = evenly.Dataset(_arrow(tmp_path, _docs()), shuffle=True, seed=2, pack=evenly.Packing(SEQ))
    planner = ds._planner
    spec = PassSpec(epoch=0, start=0, num_samples=len(LENGTHS), batch_size=3, handoff=True)

    def share(skip: int) -> list[list[int]]:
        items = planner.read(spec, 1, 2, skip=skip, collate=torch.utils.data.default_collate)
        return [row for b in items for row in b["input_ids"].tolist()]

    whole = share(0)
    assert len(whole) > 40
    for skip in (1, 2, 3, 31, 32, 33, 34, 40):
        assert share(skip) == whole[skip:]


def test_the_pad_token_is_found_in_a_later_piece_and_named(tmp_path):
    lengths = [30, 5, 7]
    docs = _docs(lengths)
    docs[0][20] = 0  # in document 0's second row (seq_len 16)
    ds = evenly.Dataset(_arrow(tmp_path, docs), pack=evenly.Packing(SEQ, pad_id=0))
    with pytest.raises(ValueError, match=r"document 0 \(position 0 of epoch 0\).*at token 20"):
        _batches(evenly.DataLoader(ds, batch_size=1))
    grow = evenly.Dataset(
        _docs(lengths), transform=lambda d: [*d, 9], pack=evenly.Packing(SEQ), shuffle=False
    )
    with pytest.raises(ValueError, match=r"document 0 .* holds 31 tokens, but 30"):
        _batches(evenly.DataLoader(grow, batch_size=1))


def test_infinite_best_fit_in_worker_processes_and_threads_is_the_in_process_stream(tmp_path):
    """Epochs of different row counts, read ahead by workers across an epoch boundary."""
    pack = evenly.Packing(SEQ, strategy="best_fit", open_rows=2, window=16)
    ds = evenly.Dataset(_arrow(tmp_path, _docs()), shuffle=True, seed=4, pack=pack)
    lengths = []
    for e in range(3):
        epoch = evenly.DataLoader(ds, batch_size=1)
        epoch.set_epoch(e)
        lengths.append(len(epoch))
    assert len(set(lengths)) > 1

    def stream(**kwargs: Any) -> list[list[int]]:
        loader = evenly.DataLoader(ds, batch_size=4, infinite=True, **kwargs)
        it = iter(loader)
        steps = (sum(lengths) - 1) // 4  # into the last row of epoch 2
        rows = [row for _ in range(steps) for row in next(it)["input_ids"].tolist()]
        assert loader.state_dict()["epoch"] == 2
        return rows

    alone = stream()
    assert stream(num_workers=2, worker_type="thread") == alone
    assert stream(num_workers=2, worker_type="process") == alone
    assert stream(num_workers=1, multiprocessing_context="spawn") == alone


def test_workers_forked_while_a_reader_thread_holds_the_plan_lock_read_the_same_rows(tmp_path):
    """A reader thread of an abandoned ``worker_type="thread"`` pass may hold the packing
    plan's lock at the instant the next loader forks its workers: the workers must not
    inherit it held (they hung in ``PlanFiles.table`` for ever)."""
    pack = evenly.Packing(SEQ, strategy="best_fit", open_rows=2, window=16)
    ds = evenly.Dataset(_arrow(tmp_path, _docs()), shuffle=True, seed=4, pack=pack)
    alone = [b["input_ids"].tolist() for b in evenly.DataLoader(ds, batch_size=4)]
    planner = planner_of(ds)
    lock = planner.strategy.files(planner.view)._lock  # what a reader thread takes
    armed, held, release = [True], threading.Event(), threading.Event()

    def reader_thread() -> None:
        with lock:
            held.set()
            release.wait(120)

    def before_the_first_fork() -> None:  # a thread takes the lock, then the fork
        if armed[0]:
            armed[0] = False
            threading.Thread(target=reader_thread, daemon=True).start()
            held.wait(30)

    os.register_at_fork(before=before_the_first_fork, after_in_parent=release.set)
    try:
        loader = evenly.DataLoader(
            ds,
            batch_size=4,
            num_workers=2,
            worker_type="process",
            multiprocessing_context="fork",
            timeout=60,
        )
        got = [b["input_ids"].tolist() for b in loader]
    finally:
        armed[0] = False
        release.set()
    assert held.is_set()  # the first worker was forked with the lock held
    assert got == alone


def _arrow_files(tmp_path: Any, docs: list[list[int]], kind: pa.DataType) -> str:
    """``docs`` in three Arrow files of several record batches each."""
    for f, lo in enumerate(range(0, len(docs), 60)):
        part = pa.table({"input_ids": pa.array(docs[lo : lo + 60], type=pa.list_(kind))})
        with pa.ipc.new_file(str(tmp_path / f"docs-{f}.arrow"), part.schema) as writer:
            for at in range(0, part.num_rows, 25):
                writer.write_table(part.slice(at, 25))
    return str(tmp_path)


@pytest.mark.parametrize("kind", [pa.int32(), pa.uint16(), pa.int64()])
@pytest.mark.parametrize("strategy", ["concat", "best_fit"])
def test_the_token_window_of_arrow_files_gives_the_rows_of_the_documents_themselves(
    tmp_path, kind, strategy, monkeypatch
):
    # documents located and gathered through one window over every file's token buffers
    # give the rows the same documents give as Python lists (read one by one)
    docs = [[t % 60000 for t in d] for d in _docs()]
    source = evenly.from_arrow(_arrow_files(tmp_path, docs, kind))
    assert len(source.urls) == 3 and source.token_ranges(np.arange(5), "input_ids") is not None
    pack = evenly.Packing(SEQ, strategy=strategy, pad_id=60001)

    def rows(src: Any, **kw: Any) -> list[list[int]]:
        ds = evenly.Dataset(src, shuffle=True, seed=3, pack=pack)
        loader = evenly.DataLoader(ds, batch_size=3, **kw)
        return [r for b in _batches(loader) for r in b["input_ids"] + b["labels"]]

    want = rows(docs)
    gathers = []
    gather = TokenSpan.gather
    monkeypatch.setattr(TokenSpan, "gather", lambda self, *a: gathers.append(1) or gather(self, *a))
    assert rows(source) == want
    assert gathers  # the loader read through the window, not document by document
    assert rows(source, num_workers=2, worker_type="thread") == want
    assert rows(source, num_workers=2, worker_type="process") == want


def test_more_files_than_stay_open_give_the_rows_of_the_documents_themselves(tmp_path):
    # over max_open_files the documents are read one by one, and a read group's files
    # evict each other's maps mid-read: the views taken before an eviction keep their
    # map (pyarrow unmaps on the last view's release), so the rows stay exact
    docs = _docs()
    source = evenly.from_arrow(_arrow_files(tmp_path, docs, pa.int32()))
    source.max_open_files = 1  # three files: every read opens and closes maps
    assert source.token_ranges(np.arange(5), "input_ids") is None  # the one-by-one path
    pack = evenly.Packing(SEQ, pad_id=0)

    def rows(src: Any, **kw: Any) -> list[list[int]]:
        ds = evenly.Dataset(src, shuffle=True, seed=4, pack=pack)
        return [
            r for b in _batches(evenly.DataLoader(ds, batch_size=5, **kw)) for r in b["input_ids"]
        ]

    want = rows(docs)
    assert rows(source) == want
    assert rows(source, num_workers=2, worker_type="thread") == want
    assert rows(source, num_workers=2, worker_type="process") == want
    assert len(source._handles) <= 1


def test_a_token_window_read_checks_each_file_it_reads_unchanged(tmp_path):
    docs = _docs()
    folder = _arrow_files(tmp_path, docs, pa.int32())
    ds = evenly.Dataset(evenly.from_arrow(folder), shuffle=True, seed=1, pack=evenly.Packing(SEQ))
    it = iter(evenly.DataLoader(ds, batch_size=2))
    next(it)  # the first read: one batch; the next read comes after the rewrite
    path = tmp_path / "docs-0.arrow"
    size = path.stat().st_size
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    _arrow_files(scratch, [[t + 1 for t in d] for d in docs[:60]], pa.int32())
    data = (scratch / "docs-0.arrow").read_bytes()
    assert len(data) == size  # the same layout, other tokens
    with open(path, "r+b") as f:  # rewritten in place: the map now shows other tokens
        f.write(data)
    with (
        pytest.raises(ValueError, match=r"docs-0.arrow changed while it was mapped"),
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("ignore", evenly.EvenlyWarning)
        for _ in it:
            pass


def test_a_replaced_source_is_packed_in_its_own_block_order(tmp_path):
    # the block shuffle orders documents by shard: a packed dataset whose source is
    # replaced by one of the same length in other shards reads the rows a fresh dataset
    # over it reads (the document order of the old source's shards was kept before)
    def shards(name: str, sizes: list[int]) -> Any:
        (tmp_path / name).mkdir()
        table = pa.table({"input_ids": pa.array(_docs(LENGTHS[:120]), type=pa.list_(pa.int32()))})
        at = 0
        for k, n in enumerate(sizes):
            with pa.ipc.new_file(str(tmp_path / name / f"s{k:02d}.arrow"), table.schema) as w:
                w.write_table(table.slice(at, n))
            at += n
        return evenly.from_arrow(str(tmp_path / name))

    def dataset(source: Any) -> evenly.Dataset[Any]:
        pack = evenly.Packing(SEQ)
        return evenly.Dataset(source, shuffle="block", block_shards=2, seed=3, pack=pack)

    ten, thirty = shards("ten", [10] * 12), shards("thirty", [30] * 4)
    ds = dataset(ten)
    _batches(evenly.DataLoader(ds, batch_size=4))  # epoch 0 over the first source
    ds.source = thirty
    ds.set_epoch(0)
    got = _batches(evenly.DataLoader(ds, batch_size=4))
    assert got == _batches(evenly.DataLoader(dataset(thirty), batch_size=4))


def test_a_packer_pickles_without_its_recycled_buffers(tmp_path):
    # a spawned worker gets the dataset pickled: the main process's pooled buffers (tens
    # of MB after reading in-process) must not travel with it
    import pickle

    ds = evenly.Dataset(_arrow(tmp_path, _docs()), shuffle=True, seed=2, pack=evenly.Packing(SEQ))
    kept = _batches(evenly.DataLoader(ds, batch_size=4))  # read here: the pools fill
    assert kept
    packer = ds._planner.strategy
    assert isinstance(packer, PackedRows) and packer._pools
    assert sum(len(pool._free) for pool in packer._pools.values()) > 0
    copy = pickle.loads(pickle.dumps(packer))
    assert copy._pools == {}


def test_reads_through_the_windows_go_on_after_the_source_closes_its_files(tmp_path):
    # the token window (packing) and the column window (columnar batches) view the files'
    # maps: after source.close() they are made again from the reopened files (the
    # columnar one raised KeyError before)
    docs = _docs()
    (tmp_path / "t").mkdir()
    source = evenly.from_arrow(_arrow_files(tmp_path / "t", docs, pa.int32()))
    ds = evenly.Dataset(source, shuffle=True, seed=6, pack=evenly.Packing(SEQ))
    want = [r for b in _batches(evenly.DataLoader(ds, batch_size=2)) for r in b["input_ids"]]
    it = iter(evenly.DataLoader(ds, batch_size=2))
    got = next(it)["input_ids"].tolist()
    source.close()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", evenly.EvenlyWarning)
        got += [r for b in it for r in b["input_ids"].tolist()]
    assert got == want

    schema = pa.schema([("idx", pa.int64()), ("x", pa.list_(pa.int16(), 3))])
    rows = ({"idx": i, "x": np.full(3, i % 97, np.int16)} for i in range(500))
    evenly.write(rows, tmp_path / "c", "arrow", 120, schema=schema, progress=False)
    columns = evenly.from_arrow(tmp_path / "c")
    loader = evenly.DataLoader(evenly.Dataset(columns, shuffle=True, seed=2), batch_size=16)
    first = [b["idx"].tolist() for b in loader]
    it = iter(loader)
    seen = [next(it)["idx"].tolist()]
    columns.close()
    for b in it:
        assert torch.equal(b["x"], (b["idx"] % 97).to(torch.int16)[:, None].expand(-1, 3))
        seen.append(b["idx"].tolist())
    assert sorted(i for b in seen for i in b) == list(range(500))
    assert len(first) == len(seen)
