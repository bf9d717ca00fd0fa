"""Packing's cached lengths (and the plans keyed by them) belong to the data they were
computed from: two corpora whose checkpoint fingerprints agree (the same file names and
row counts: Arrow, HF ``datasets``, Megatron, JSONL text under one ``tokenizer_id``), or a
corpus rewritten in place, each get their own lengths, and read every token of every
document; a stale or damaged entry is computed again, never an error.

Documents hold tokens that name them: document ``i``'s token ``t`` is
``base + 1000 * (i + 1) + t``, so two corpora never share a token."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

import evenly

SEQ = 16
ROWS = 24


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("EVENLY_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def docs(seed: int, base: int) -> list[list[int]]:
    """``ROWS`` documents of 1..40 tokens (other lengths for another seed)."""
    lengths = np.random.default_rng(seed).integers(1, 40, size=ROWS)
    return [[base + 1000 * (i + 1) + t for t in range(int(n))] for i, n in enumerate(lengths)]


def packed_tokens(source: Any, pack: evenly.Packing | None = None, workers: int = 0) -> list[int]:
    """Every real token of one packed epoch, in row order (pad id 0 left out)."""
    ds = evenly.Dataset(source, shuffle=False, pack=pack or evenly.Packing(SEQ))
    loader = evenly.DataLoader(ds, batch_size=2, num_workers=workers)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", evenly.EvenlyWarning)  # the epoch's pad rows
        return [t for b in loader for row in b["input_ids"].tolist() for t in row if t]


def write_arrow(path: Path, documents: list[list[int]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table({"input_ids": pa.array(documents, type=pa.list_(pa.int32()))})
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table, max_chunksize=10)


def flat(documents: list[list[int]]) -> list[int]:
    return [t for d in documents for t in d]


def test_two_arrow_corpora_with_the_same_names_and_row_counts_keep_their_own_lengths(
    tmp_path: Path,
) -> None:
    a, b = docs(1, 0), docs(2, 100_000)
    write_arrow(tmp_path / "a" / "part-0.arrow", a)
    write_arrow(tmp_path / "b" / "part-0.arrow", b)
    src_a, src_b = evenly.from_arrow(str(tmp_path / "a")), evenly.from_arrow(str(tmp_path / "b"))
    assert src_a.fingerprint == src_b.fingerprint  # checkpoints cannot tell them apart
    assert packed_tokens(src_a) == flat(a)
    assert packed_tokens(src_b) == flat(b)


@pytest.mark.parametrize("workers", [0, 2])
def test_an_arrow_corpus_rewritten_in_place_is_packed_from_its_new_lengths(
    tmp_path: Path, workers: int
) -> None:
    path = tmp_path / "corpus" / "part-0.arrow"
    old, new = docs(1, 0), docs(2, 100_000)
    write_arrow(path, old)
    assert packed_tokens(evenly.from_arrow(str(path.parent)), workers=workers) == flat(old)
    write_arrow(path, new)  # the same file, the same row count, other documents
    assert packed_tokens(evenly.from_arrow(str(path.parent)), workers=workers) == flat(new)


def test_two_hf_datasets_with_the_same_file_names_and_rows_keep_their_own_lengths(
    tmp_path: Path,
) -> None:
    datasets = pytest.importorskip("datasets")
    a, b = docs(1, 0), docs(2, 100_000)
    datasets.Dataset.from_dict({"input_ids": a}).save_to_disk(str(tmp_path / "a"))
    datasets.Dataset.from_dict({"input_ids": b}).save_to_disk(str(tmp_path / "b"))
    src_a, src_b = (evenly.from_arrow(datasets.load_from_disk(str(tmp_path / d))) for d in "ab")
    assert src_a.fingerprint == src_b.fingerprint
    assert packed_tokens(src_a) == flat(a)
    assert packed_tokens(src_b) == flat(b)


def test_two_megatron_corpora_with_the_same_name_and_sizes_keep_their_own_lengths(
    tmp_path: Path,
) -> None:
    from evenly.sources._megatron import write_megatron

    a = docs(1, 0)
    b = [list(range(100_000, 100_000 + len(d))) for d in reversed(a)]  # same total tokens
    assert [len(d) for d in b] != [len(d) for d in a]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    write_megatron(tmp_path / "a" / "corpus", a)
    write_megatron(tmp_path / "b" / "corpus", b)
    src_a = evenly.from_megatron(tmp_path / "a" / "corpus")
    src_b = evenly.from_megatron(tmp_path / "b" / "corpus")
    assert src_a.fingerprint == src_b.fingerprint
    assert packed_tokens(src_a) == flat(a)
    assert packed_tokens(src_b) == flat(b)


def _tokenize(texts: list[str]) -> list[list[int]]:
    return [[ord(c) for c in text] for text in texts]


def test_two_text_corpora_with_the_same_file_names_and_line_counts_keep_their_own_lengths(
    tmp_path: Path,
) -> None:
    texts = {
        "a": [f"a{i}:" + "x" * (i % 7) for i in range(ROWS)],
        "b": [f"b{i}:" + "y" * (3 * i % 23) for i in range(ROWS)],
    }
    for name, lines in texts.items():
        (tmp_path / name).mkdir()
        with open(tmp_path / name / "train.jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps({"text": t}) + "\n" for t in lines)
    pack = evenly.Packing(SEQ, tokenize=_tokenize, tokenizer_id="ord-v1")
    for name, lines in texts.items():
        source = evenly.from_jsonl(str(tmp_path / name))
        assert packed_tokens(source, pack) == flat(_tokenize(lines))


def test_a_damaged_lengths_file_is_computed_again(tmp_path: Path, _cache: Path) -> None:
    documents = docs(1, 0)
    write_arrow(tmp_path / "c" / "part-0.arrow", documents)
    assert packed_tokens(evenly.from_arrow(str(tmp_path / "c"))) == flat(documents)
    (cached,) = [p for p in (_cache / "lengths").iterdir() if p.suffix == ".i32"]
    with open(cached, "r+b") as f:
        f.truncate(os.path.getsize(cached) - 4)  # cut short (a full disk, a bad copy)
    assert packed_tokens(evenly.from_arrow(str(tmp_path / "c"))) == flat(documents)
    assert os.path.getsize(cached) == 4 * ROWS
