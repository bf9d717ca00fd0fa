"""Packing over each token source: Megatron ``.bin/.idx`` files (lengths from the index,
with no document read), text tokenized on the fly in the workers with an HF tokenizer
(batched calls, lengths computed once per tokenizer id and cached), and shards written by
``evenly write --tokenize``: every token of every document exactly once, in order, under
real workers (fork and spawn)."""

from __future__ import annotations

import threading
from collections import defaultdict
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest

import evenly
import evenly.runtime.lengths as lengths_module
import evenly.sources as es
from evenly.sources._megatron import MegatronSource, write_megatron
from evenly.sources._tokenize import Tokenizer
from tests.tokens_helpers import corpus, fast_tokenizer, tiny_tokenizer

#: the epoch's tail is pad rows (reported by a warning): what these tests check is the
#: documents' tokens, and that pads are marked
pytestmark = pytest.mark.filterwarnings("ignore:evenly. .* pad row:evenly.errors.EvenlyWarning")


@pytest.fixture(autouse=True)
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("EVENLY_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def documents_seen(loader: Any) -> dict[int, list[int]]:
    """Source index -> its tokens, concatenated in the order the loader yielded them
    (one rank: rows come in the epoch's order); checks the rows' shape and pads."""
    seen: dict[int, list[int]] = defaultdict(list)
    for batch in loader:
        ids, docs, labels = batch["input_ids"], batch["document_ids"], batch["labels"]
        assert ids.shape == docs.shape == labels.shape and ids.shape[1] == loader.seq_len
        assert bool((labels[docs == 0] == -100).all())
        for row_ids, row_docs in zip(ids.tolist(), docs.tolist(), strict=True):
            for token, doc in zip(row_ids, row_docs, strict=True):
                if doc:
                    seen[doc - 1].append(token)
    return dict(seen)


def loader_of(source: Any, pack: evenly.Packing, **kwargs: Any) -> Any:
    ds: evenly.Dataset[Any] = evenly.Dataset(source, shuffle=True, seed=5, pack=pack)
    loader = evenly.DataLoader(ds, batch_size=3, timeout=60, **kwargs)
    loader.seq_len = pack.seq_len  # for documents_seen
    return loader


def lognormal_docs(n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    lengths = np.minimum(rng.lognormal(np.log(40), 1.0, n).astype(int), 400)
    return [rng.integers(1, 50_000, int(k)) for k in lengths]


@pytest.mark.parametrize("strategy", ["concat", "best_fit"])
def test_megatron_files_packed_every_token_once_in_order(tmp_path: Path, strategy: str) -> None:
    docs = lognormal_docs(300)
    write_megatron(tmp_path / "c", docs, dtype=np.uint16)
    pack = evenly.Packing(128, strategy=strategy, document_ids=True)
    loader = loader_of(evenly.from_megatron(tmp_path / "c"), pack, num_workers=2)
    seen = documents_seen(loader)
    assert seen == {i: d.tolist() for i, d in enumerate(docs) if d.size}


def test_megatron_lengths_come_from_the_index_with_no_document_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    docs = lognormal_docs(200, seed=1)
    write_megatron(tmp_path / "c", docs)
    src = evenly.from_megatron(tmp_path / "c")

    def no_reads(self: Any, indices: Any) -> Any:
        raise AssertionError("a document was read to find the lengths")

    monkeypatch.setattr(MegatronSource, "__getitems__", no_reads)
    monkeypatch.setattr(MegatronSource, "__getitem__", no_reads)
    ds: evenly.Dataset[Any] = evenly.Dataset(src, shuffle=True, seed=0, pack=evenly.Packing(64))
    total = sum(d.size for d in docs)
    assert len(ds) == -(-total // 64)  # concat: the rows the tokens fill


class CountingTokenizer:
    """``evenly.tokenizer(tok)`` that records the batch size of each call in this process."""

    calls: ClassVar[list[int]] = []

    def __init__(self, tk: Any) -> None:
        self.tk = tk
        self.tokenizer_id = tk.tokenizer_id

    def __call__(self, texts: list[str]) -> list[list[int]]:
        type(self).calls.append(len(texts))
        return list(self.tk(texts))


def test_text_tokenized_on_the_fly_every_token_once_lengths_cached(tmp_path: Path) -> None:
    texts = corpus(150, seed=2)
    tk = evenly.tokenizer(tiny_tokenizer(texts), append_eos=True)
    es.write([{"text": t, "id": i} for i, t in enumerate(texts)], tmp_path / "raw", "jsonl")
    src = es.from_jsonl(tmp_path / "raw")
    counting = CountingTokenizer(tk)
    CountingTokenizer.calls = []
    pack = evenly.Packing(
        48, tokenize=counting, tokenizer_id=tk.tokenizer_id, pad_id=0, document_ids=True
    )
    loader = loader_of(src, pack, num_workers=2, multiprocessing_context="spawn")
    seen = documents_seen(loader)
    assert seen == dict(enumerate(tk(texts)))
    lengths_pass = list(CountingTokenizer.calls)  # the main process's first pass
    assert lengths_pass and sum(lengths_pass) == len(texts) and max(lengths_pass) > 1
    # the lengths are cached per (source, tokenizer id): a new dataset does not tokenize
    CountingTokenizer.calls = []
    again = loader_of(src, pack, num_workers=0)
    assert len(again) == len(loader) and CountingTokenizer.calls == []
    assert list((tmp_path / "cache" / "lengths").glob("*.i32"))


def test_a_transformers_tokenizer_packs_on_the_fly(tmp_path: Path) -> None:
    texts = corpus(80, seed=3)
    fast = fast_tokenizer(tiny_tokenizer(texts))
    tk = evenly.tokenizer(fast)
    pack = evenly.Packing(
        40,
        strategy="best_fit",
        tokenize=tk,
        tokenizer_id=tk.tokenizer_id,
        pad_id=fast.pad_token_id,
        document_ids=True,
    )
    seen = documents_seen(loader_of(texts, pack, num_workers=2))
    assert seen == dict(enumerate(fast(texts)["input_ids"]))
    # evenly.tokenizer(tok) carries its id: one line, and an explicit id still wins
    assert evenly.Packing(40, tokenize=tk).tokenizer_id == tk.tokenizer_id
    assert evenly.Packing(40, tokenize=tk, tokenizer_id="mine").tokenizer_id == "mine"


def test_shards_from_evenly_write_tokenize_pack_with_lengths_from_the_column(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    texts = corpus(120, seed=4)
    tk = evenly.tokenizer(tiny_tokenizer(texts), append_eos=True)
    es.write(texts, tmp_path / "tok", "arrow", 50, tokenize=tk, progress=False)
    src = es.from_arrow(tmp_path / "tok")
    pack = evenly.Packing(64, document_ids=True)
    seen = documents_seen(loader_of(src, pack, num_workers=2))
    assert seen == dict(enumerate(tk(texts)))


class ThreadNoting(Tokenizer):
    """``evenly.tokenizer(tok)`` that notes the thread of each call (and of each copy)."""

    threads: ClassVar[list[str]] = []
    #: the first two calls wait for each other: they must run at once, in two threads
    meet: ClassVar[threading.Barrier | None] = None

    def __call__(self, texts: list[str]) -> list[list[int]]:
        noted = type(self).threads
        noted.append(threading.current_thread().name)
        if self.meet is not None and len(noted) <= 2:
            self.meet.wait()
        return super().__call__(texts)


@pytest.mark.parametrize("kind", ["tokenizers", "transformers"])
def test_the_tokenize_lengths_pass_runs_in_threads_and_equals_the_sequential_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    monkeypatch.setattr(lengths_module, "BATCH", 25)  # 12 batches over 3 threads
    monkeypatch.setattr(lengths_module, "THREADS", 3)
    texts = corpus(300, seed=4)
    tok = tiny_tokenizer(texts)
    tk = ThreadNoting(
        tok if kind == "tokenizers" else fast_tokenizer(tok),
        add_special_tokens=True,
        append_eos=False,
    )
    es.write([{"text": t} for t in texts], tmp_path / "raw", "jsonl", 70, progress=False)
    src = es.from_jsonl(tmp_path / "raw")
    ThreadNoting.threads = []
    ThreadNoting.meet = threading.Barrier(2, timeout=60)  # a lone thread: BrokenBarrierError
    ds = evenly.Dataset(src, pack=evenly.Packing(32, tokenize=tk))
    rows = len(ds)
    ThreadNoting.meet = None
    names = set(ThreadNoting.threads)
    assert len(ThreadNoting.threads) == 12 and all(n.startswith("evenly-lengths") for n in names)
    assert len(names) > 1  # two calls ran at once (each thread with its own source copy)
    sequential = evenly.Packing(32, tokenize=lambda t: tk(t), tokenizer_id="same-but-serial")
    assert len(evenly.Dataset(src, pack=sequential)) == rows
    lengths = ds._planner.strategy.files(ds._planner.view).lengths
    assert np.asarray(lengths).tolist() == [len(ids) for ids in tk(texts)]
    if kind == "transformers":  # a transformers tokenizer is copied for each thread
        assert tk.for_thread().tok is not tk.tok
    else:
        assert tk.for_thread() is tk
    ThreadNoting.threads = []  # cached per tokenizer id: a new dataset does not tokenize
    assert (
        len(evenly.Dataset(es.from_jsonl(tmp_path / "raw"), pack=evenly.Packing(32, tokenize=tk)))
        == rows
    )
    assert ThreadNoting.threads == []


def test_a_failing_document_in_a_threaded_lengths_pass_is_named_in_the_main_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lengths_module, "BATCH", 10)
    monkeypatch.setattr(lengths_module, "THREADS", 2)
    texts = corpus(60, seed=5)
    rows = [{"text": t} for t in texts]
    rows[47] = {"body": "no text"}
    es.write(rows, tmp_path / "raw", "jsonl")
    tk = evenly.tokenizer(tiny_tokenizer(texts))
    ds = evenly.Dataset(es.from_jsonl(tmp_path / "raw"), pack=evenly.Packing(32, tokenize=tk))
    with pytest.raises(TypeError, match="document 47 has no text to tokenize"):
        len(ds)
    assert not list((tmp_path / "cache" / "lengths").glob("*.i32"))  # nothing half-written
