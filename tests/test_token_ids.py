"""Token ids are checked where they enter packing: a negative id (-100, the loss's ignore
index, among them), an id not below ``Packing(vocab_size=...)`` (or the tokenizer's
vocabulary), an unsigned id of 2^63 or more (which int64 rows would read as negative)
raise in the main process, naming the source, the document (file and row where known),
the id and the setting; over each way tokens come in: pre-tokenized Arrow (read through
the token window) and Parquet list columns, Megatron ``.bin/.idx``, tokenizing on the
fly, in-memory lists, a token mixture; with real worker processes too.  And
``evenly.write(tokenize=...)`` refuses to write an id it would get wrong."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

import evenly
from evenly.sources._megatron import write_megatron
from tests.tokens_helpers import corpus, fast_tokenizer, tiny_tokenizer

pytestmark = pytest.mark.filterwarnings("ignore:evenly. .* pad row:evenly.errors.EvenlyWarning")

BAD_DOC, BAD_AT = 7, 3  # the document holding the bad id, and where in it
#: kind -> (the bad id, Packing keywords, what the message says about it)
KINDS: dict[str, tuple[int, dict[str, Any], str]] = {
    "negative": (-5, {}, r"the negative token id -5 \(at token 3\): token ids are non-negative"),
    "ignore-index": (-100, {}, r"token id -100 \(at token 3\): the loss's ignore index"),
    "beyond-vocab": (
        70_000,
        {"vocab_size": 32_000},
        r"token id 70000 \(at token 3\), not below Packing\(vocab_size=32000\)",
    ),
    "unsigned": (
        2**63 + 5,
        {},
        r"the unsigned token id 9223372036854775813 \(at token 3, stored as uint64\), above "
        r"int64's range",
    ),
}


@pytest.fixture(autouse=True)
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("EVENLY_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def documents(bad: int | None, dtype: Any = np.int64) -> list[np.ndarray]:
    """20 documents of ids in [1, 1000) (every one below 32,000, none the pad id 0);
    document ``BAD_DOC`` holds ``bad`` at ``BAD_AT``."""
    rng = np.random.default_rng(4)
    docs = [rng.integers(1, 1000, int(rng.integers(5, 30))).astype(dtype) for _ in range(20)]
    if bad is not None:
        docs[BAD_DOC][BAD_AT] = bad
    return docs


def named(source: str, where: str | None = None) -> str:
    """The pattern of how an error names document ``BAD_DOC`` of ``source`` (at
    ``where``: its file and row)."""
    at = "" if where is None else f", {where}"
    return rf"document {BAD_DOC} \(position \d+ of epoch 0\) of the {source}{at},"


def packed(source: Any, num_workers: int = 0, **packing: Any) -> list[Any]:
    """One epoch of packed batches of ``source``."""
    pack = evenly.Packing(16, **packing)
    ds: evenly.Dataset[Any] = evenly.Dataset(source, shuffle=True, seed=1, pack=pack)
    kwargs: dict[str, Any] = {"num_workers": num_workers}
    if num_workers:
        kwargs.update(worker_type="process", timeout=60)
    return list(evenly.DataLoader(ds, batch_size=2, **kwargs))


def written(tmp_path: Path, fmt: str, docs: list[np.ndarray]) -> Any:
    """``docs`` as an ``input_ids`` list column of Arrow or Parquet shards of 5 rows (the
    bad document is row 2 of the second), opened."""
    schema = pa.schema([("input_ids", pa.list_(pa.from_numpy_dtype(docs[0].dtype)))])
    evenly.write(
        [{"input_ids": d} for d in docs], tmp_path / fmt, fmt, 5, schema=schema, progress=False
    )
    return (evenly.from_arrow if fmt == "arrow" else evenly.from_parquet)(tmp_path / fmt)


@pytest.mark.parametrize("fmt", ["arrow", "parquet"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_a_bad_id_in_a_list_column_names_the_file_row_and_id(
    tmp_path: Path, fmt: str, kind: str
) -> None:
    bad, settings, says = KINDS[kind]
    dtype = np.uint64 if kind == "unsigned" else np.int64
    source = written(tmp_path, fmt, documents(bad, dtype))
    where = named(r"\w+Source", rf"\S+shard-00001\.{fmt} row 2")
    with pytest.raises(ValueError, match=rf"evenly: packing: {where} holds {says}"):
        packed(source, **settings)


@pytest.mark.parametrize("kind", ["negative", "ignore-index", "beyond-vocab"])
def test_a_bad_id_in_megatron_files_names_the_sequence(tmp_path: Path, kind: str) -> None:
    bad, settings, says = KINDS[kind]
    write_megatron(tmp_path / "c", documents(bad), dtype=np.int32)
    where = named("MegatronSource", r"\S+c\.bin sequence 7")
    with pytest.raises(ValueError, match=rf"{where} holds {says}"):
        packed(evenly.from_megatron(tmp_path / "c"), **settings)


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_bad_id_in_memory_names_the_document(kind: str) -> None:
    bad, settings, says = KINDS[kind]
    docs = documents(bad, np.uint64 if kind == "unsigned" else np.int64)
    with pytest.raises(
        ValueError,
        match=rf"{named('list')} holds {says}",
    ):
        packed(docs, **settings)
    listed = [d.tolist() for d in documents(bad if kind != "unsigned" else None)]
    if kind != "unsigned":  # python ints too
        with pytest.raises(
            ValueError,
            match=rf"{named('list')} holds {says}",
        ):
            packed(listed, **settings)


def test_ids_below_the_vocabulary_size_and_unchecked_ones_pack_as_before() -> None:
    docs = documents(31_999)  # the largest id a vocabulary of 32,000 has
    plain = [b["input_ids"].tolist() for b in packed(docs)]
    checked = [b["input_ids"].tolist() for b in packed(docs, vocab_size=32_000)]
    assert checked == plain
    tokens = [t for batch in plain for row in batch for t in row if t]
    assert sorted(tokens) == sorted(t for d in docs for t in d.tolist())
    with pytest.raises(ValueError, match=r"document 7 .* Packing\(vocab_size=31999\)"):
        packed(docs, vocab_size=31_999)
    with pytest.raises(ValueError, match=r"Packing\(vocab_size\) must be >= 1, got 0"):
        evenly.Packing(16, vocab_size=0)
    with pytest.raises(TypeError, match=r"Packing\(vocab_size\) must be an integer"):
        evenly.Packing(16, vocab_size=3.5)  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", ["ignore-index", "unsigned"])
def test_a_bad_id_from_a_list_column_is_named_by_a_worker_process(
    tmp_path: Path, kind: str
) -> None:
    bad, settings, says = KINDS[kind]
    dtype = np.uint64 if kind == "unsigned" else np.int64
    source = written(tmp_path, "arrow", documents(bad, dtype))
    with pytest.raises(
        ValueError,
        match=rf"{named('ArrowSource', r'.*')} holds {says}",
    ):
        packed(source, num_workers=2, **settings)


class Shifting:
    """A tokenizer (``evenly.tokenizer``'s attributes forwarded) that gives document
    ``BAD_DOC`` (the text starting with ``doc7``) ``bad`` at token ``BAD_AT``."""

    def __init__(self, tk: Any, bad: int) -> None:
        self.tk, self.bad = tk, bad
        self.tokenizer_id = tk.tokenizer_id
        if hasattr(tk, "vocab_size"):
            self.vocab_size = tk.vocab_size

    def __call__(self, texts: list[str]) -> list[list[int]]:
        out = self.tk(texts)
        for text, ids in zip(texts, out, strict=True):
            if text.startswith(f"doc{BAD_DOC} "):
                ids[BAD_AT] = self.bad
        return out


@pytest.mark.parametrize(
    ("kind", "num_workers"),
    [*((kind, 0) for kind in KINDS), ("beyond-the-tokenizer's-vocab", 2)],
)
def test_a_bad_id_from_the_tokenizer_names_the_document(
    tmp_path: Path, kind: str, num_workers: int
) -> None:
    texts = corpus(30, seed=3)
    tk = evenly.tokenizer(tiny_tokenizer(texts))  # a vocabulary of 200
    evenly.write([{"text": t} for t in texts], tmp_path / "raw", "jsonl", progress=False)
    source = evenly.from_jsonl(tmp_path / "raw")
    where = named("JsonlSource", r"\S+shard-00000\.jsonl row 7")
    settings: dict[str, Any] = {}
    if kind == "beyond-the-tokenizer's-vocab":
        size = tk.vocab_size  # vocab_size taken from the tokenizer
        bad = size
        says = (
            rf"{where} holds token id {bad} \(at token 3\), not below "
            rf"Packing\(vocab_size={size}\) \(the tokenizer's\)"
        )
    elif kind == "beyond-vocab":  # the model's own, given
        size = max(tk.tok.get_vocab().values()) + 1
        bad, settings = size + 60, {"vocab_size": size + 50}
        says = (
            rf"{where} holds token id {bad} \(at token 3\), not below "
            rf"Packing\(vocab_size={size + 50}\):"
        )
    elif kind == "unsigned":  # a Python int int64 cannot hold
        bad = 2**63 + 5
        says = rf"Packing\(tokenize=...\) gave {where} the token id {bad}, outside int64's range"
    else:
        bad, _, says = KINDS[kind]
        says = rf"{where} holds {says}"
    pack = {"tokenize": Shifting(tk, bad), "pad_id": 0, **settings}
    with pytest.raises(ValueError, match=says):
        packed(source, num_workers=num_workers, **pack)


def test_the_vocabulary_size_comes_from_evenly_tokenizer() -> None:
    tok = tiny_tokenizer(corpus(50))
    tk = evenly.tokenizer(tok)
    size = tok.get_vocab_size(with_added_tokens=True)
    assert tk.vocab_size == size == max(tok.get_vocab().values()) + 1
    assert evenly.Packing(16, tokenize=tk).vocab_size == size
    assert evenly.Packing(16, tokenize=tk, vocab_size=256).vocab_size == 256  # the model's
    assert evenly.tokenizer(fast_tokenizer(tok)).vocab_size == size


def test_a_bad_id_in_a_token_mixture_names_the_source_and_sample() -> None:
    good = [d.tolist() for d in documents(None)]
    bad = [d.tolist() for d in documents(-100)]
    mix = evenly.Mix({"good": good, "bad": bad}, unit="tokens")
    pattern = rf"of the Mix, source 'bad' sample {BAD_DOC}, holds {KINDS['ignore-index'][2]}"
    with pytest.raises(ValueError, match=pattern):
        packed(mix)


@pytest.mark.parametrize(
    ("kind", "says"),
    [
        ("negative", r"token id -100, negative \(-100 is the loss's ignore index\)"),
        ("beyond-int32", r"token id 4294967301, outside int32's range"),  # would wrap to 5
        (
            "beyond-the-tokenizer's-vocab",
            r"token id (\d+), not below the tokenizer's vocabulary size \1",
        ),
    ],
)
def test_write_tokenize_refuses_an_id_it_would_write_wrong(
    tmp_path: Path, kind: str, says: str
) -> None:
    texts = corpus(12, seed=5)
    tk = evenly.tokenizer(tiny_tokenizer(texts))
    tokenize: Any = Shifting(tk, tk.vocab_size if kind.endswith("vocab") else -100)
    if kind == "beyond-int32":  # a plain function (no vocabulary size) giving numpy int64s
        shifting = Shifting(tk, 2**32 + 5)

        def tokenize(texts: list[str]) -> list[Any]:
            return [np.asarray(ids, dtype=np.int64) for ids in shifting(texts)]

    with pytest.raises(ValueError, match=rf"write\(tokenize=...\): sample {BAD_DOC}: .*{says}"):
        evenly.write(texts, tmp_path / "tok", "parquet", tokenize=tokenize, progress=False)
    assert not list((tmp_path / "tok").glob("*.parquet"))  # nothing half-written
