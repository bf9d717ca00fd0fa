"""Where tokens come from: ``evenly.tokenizer`` (an HF ``tokenizers`` / ``transformers``
tokenizer as a batched function with a stable id), ``evenly.write(tokenize=...)`` and
``evenly write --tokenize`` (text in, ``input_ids`` list<int32> shards out), and Parquet
shards written by Ray Data read as they are (optional: skipped without ``ray``)."""

from __future__ import annotations

import argparse
import json
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import evenly
import evenly.sources as es
from evenly.sources import _cli
from tests.tokens_helpers import corpus, fast_tokenizer, tiny_tokenizer

TEXTS = corpus(120)


@pytest.fixture(autouse=True)
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("EVENLY_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a local directory must load with no network
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def tok() -> Any:
    return tiny_tokenizer(TEXTS)


def test_tokenizer_gives_the_tokenizers_own_ids(tok: Any) -> None:
    tk = evenly.tokenizer(tok)
    assert tk(TEXTS[:7]) == [tok.encode(t).ids for t in TEXTS[:7]]
    bos, eos = tok.token_to_id("[BOS]"), tok.token_to_id("[EOS]")
    assert all(ids[0] == bos for ids in tk(TEXTS[:7]))
    plain = evenly.tokenizer(tok, add_special_tokens=False)(TEXTS[:3])
    assert plain == [tok.encode(t, add_special_tokens=False).ids for t in TEXTS[:3]]
    ended = evenly.tokenizer(tok, append_eos=True)(TEXTS[:3])
    assert ended == [[*tok.encode(t).ids, eos] for t in TEXTS[:3]]


def test_a_transformers_fast_tokenizer_gives_its_call_ids(tok: Any) -> None:
    fast = fast_tokenizer(tok)
    tk = evenly.tokenizer(fast, append_eos=True)
    want = [[*ids, fast.eos_token_id] for ids in fast(TEXTS[:9])["input_ids"]]
    assert tk(TEXTS[:9]) == want
    assert tk.tokenizer_id.startswith("transformers:")


def test_the_tokenizer_id_changes_with_the_output_and_only_then(tok: Any, tmp_path: Path) -> None:
    tk = evenly.tokenizer(tok)
    again = evenly.tokenizer(tiny_tokenizer(TEXTS))  # trained again: the same tokenizer
    assert again.tokenizer_id == tk.tokenizer_id
    copy = pickle.loads(pickle.dumps(tk))
    assert copy.tokenizer_id == tk.tokenizer_id and copy(TEXTS[:4]) == tk(TEXTS[:4])
    others = {
        "other vocab": evenly.tokenizer(tiny_tokenizer(TEXTS, vocab_size=150)),
        "no specials": evenly.tokenizer(tok, add_special_tokens=False),
        "eos": evenly.tokenizer(tok, append_eos=True),
        "transformers": evenly.tokenizer(fast_tokenizer(tok)),
    }
    ids = {name: t.tokenizer_id for name, t in others.items()}
    assert len(set(ids.values())) == len(ids) and tk.tokenizer_id not in ids.values(), ids
    # loaded from a tokenizer.json file, or a saved transformers directory: no download
    tok.save(str(tmp_path / "tokenizer.json"))
    assert evenly.tokenizer(str(tmp_path / "tokenizer.json")).tokenizer_id == tk.tokenizer_id
    fast_tokenizer(tok).save_pretrained(tmp_path / "hf")
    loaded = evenly.tokenizer(str(tmp_path / "hf"))
    assert loaded(TEXTS[:5]) == tk(TEXTS[:5])


def test_append_eos_without_an_eos_token_names_the_fix() -> None:
    from tokenizers import Tokenizer, models

    bare = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    with pytest.raises(ValueError, match="no end-of-document token"):
        evenly.tokenizer(bare, append_eos=True)
    with pytest.raises(TypeError, match=r"expected a tokenizers\.Tokenizer"):
        evenly.tokenizer(42)
    with pytest.raises(TypeError, match=r"a plain function goes straight to Packing"):
        evenly.tokenizer(lambda texts: [[1] for _ in texts])


# ---- evenly.write(tokenize=...) ----------------------------------------------------
@pytest.mark.parametrize("fmt", ["parquet", "arrow"])
def test_write_tokenize_writes_int32_input_ids(tok: Any, tmp_path: Path, fmt: str) -> None:
    tk = evenly.tokenizer(tok, append_eos=True)
    samples = [{"id": i, "text": t, "url": f"u{i}"} for i, t in enumerate(TEXTS)]
    paths = es.write(
        samples,
        tmp_path / "out",
        format=fmt,
        rows_per_shard=50,
        tokenize=tk,
        keep_fields=["id"],
        tokenize_batch=32,
        progress=False,
    )
    assert len(paths) == 3
    src = es.from_parquet(tmp_path / "out") if fmt == "parquet" else es.from_arrow(tmp_path / "out")
    assert src.schema.field("input_ids").type == pa.list_(pa.int32())
    assert src.schema.names == ["input_ids", "id"]  # the text and the url are not kept
    rows = src.__getitems__(range(len(TEXTS)))
    assert [r["id"] for r in rows] == list(range(len(TEXTS)))
    assert [r["input_ids"].tolist() for r in rows] == tk(TEXTS)
    assert (tmp_path / "out" / ".evenly-manifest.json").exists()


def test_write_tokenize_takes_plain_strings_and_a_source(tok: Any, tmp_path: Path) -> None:
    tk = evenly.tokenizer(tok)
    es.write(TEXTS[:30], tmp_path / "a", tokenize=tk, progress=False)
    table = pq.read_table(tmp_path / "a")
    assert table.schema == pa.schema([("input_ids", pa.list_(pa.int32()))])
    assert table.column("input_ids").to_pylist() == tk(TEXTS[:30])
    # an evenly source of text in, token shards out
    es.write([{"text": t} for t in TEXTS[:30]], tmp_path / "txt", format="arrow", progress=False)
    es.write(es.from_arrow(tmp_path / "txt"), tmp_path / "b", tokenize=tk, progress=False)
    assert pq.read_table(tmp_path / "b").equals(table)


def test_write_tokenize_bad_input_names_the_sample(tok: Any, tmp_path: Path) -> None:
    tk = evenly.tokenizer(tok)
    with pytest.raises(ValueError, match=r"sample 3 has no field 'text' \(its fields: \['body'\]"):
        es.write([{"text": "a"}] * 3 + [{"body": "b"}], tmp_path / "x", tokenize=tk)
    with pytest.raises(TypeError, match="sample 1: the text is int, not str"):
        es.write([{"text": "a"}, {"text": 5}], tmp_path / "y", tokenize=tk, progress=False)
    with pytest.raises(ValueError, match=r"returned 1 token lists for 2 texts \(samples 0\.\.1\)"):
        es.write(["a", "b"], tmp_path / "z", tokenize=lambda texts: [[1]], progress=False)
    with pytest.raises(ValueError, match="writes 'parquet' or 'arrow' shards, not 'jsonl'"):
        es.write(["a"], tmp_path / "w", format="jsonl", tokenize=tk)
    assert not list(tmp_path.glob("[xyz]/*.parquet"))  # nothing half-written left behind


def test_cli_tokenizes_jsonl_files_into_shards(
    tok: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    raw = tmp_path / "raw"
    raw.mkdir()
    for k in range(2):
        lines = [json.dumps({"id": i, "body": TEXTS[i]}) for i in range(k * 60, k * 60 + 60)]
        (raw / f"part-{k}.jsonl").write_text("\n".join(lines) + "\n")
    tok.save(str(tmp_path / "tokenizer.json"))
    parser = argparse.ArgumentParser(prog="evenly")
    _cli.register(parser.add_subparsers(dest="command"))
    argv = ["write", f"{raw}/*.jsonl", str(tmp_path / "tok"), "--tokenize"]
    argv += [str(tmp_path / "tokenizer.json"), "--text-field", "body", "--keep-field", "id"]
    args = parser.parse_args([*argv, "--append-eos", "--rows-per-shard", "40", "--no-progress"])
    assert args.handler(args) == 0
    tk = evenly.tokenizer(tok, append_eos=True)
    assert tk.tokenizer_id in capsys.readouterr().out
    table = pq.read_table(tmp_path / "tok").sort_by("id")
    assert table.column("id").to_pylist() == list(range(120))
    assert table.column("input_ids").to_pylist() == tk(TEXTS)
    args = parser.parse_args(["write", str(raw), str(tmp_path / "t2"), "--tokenize", "nope.json"])
    assert args.handler(args) == 2
    assert "cannot load 'nope.json'" in capsys.readouterr().err


# ---- Ray Data ------------------------------------------------------------------------
def test_parquet_written_by_ray_data_is_read_as_it_is(tok: Any, tmp_path: Path) -> None:
    """Ray Data's ``map_batches`` + ``write_parquet`` (its files, its names, no manifest)
    read by ``evenly.from_parquet``: every document's tokens once."""
    ray = pytest.importorskip("ray")
    tk = evenly.tokenizer(tok)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        ds = ray.data.from_items([{"id": i, "text": t} for i, t in enumerate(TEXTS)])
        ds = ds.map_batches(
            lambda b: {"id": b["id"], "input_ids": tk(list(b["text"]))}, batch_format="numpy"
        )
        ds.repartition(4).write_parquet(str(tmp_path / "ray"))
    finally:
        ray.shutdown()
    src = es.from_parquet(tmp_path / "ray")
    rows = src.__getitems__(range(len(src)))
    got = {int(r["id"]): np.asarray(r["input_ids"]).tolist() for r in rows}
    assert got == dict(enumerate(tk(TEXTS)))


# ---- read_tokens: packing's reads from token columns ---------------------------------
def test_read_tokens_equals_the_rows_for_arrow_parquet_and_hf_datasets(tmp_path: Path) -> None:
    """One numpy slice per document, in the order asked, through every chunk layout and
    an HF ``datasets`` indices mapping (``shuffle``)."""
    datasets = pytest.importorskip("datasets")
    datasets.disable_progress_bars()
    rng = np.random.default_rng(0)
    docs = [rng.integers(1, 1000, int(n)).astype(np.int32) for n in rng.integers(0, 30, 90)]
    rows = [{"id": i, "input_ids": d} for i, d in enumerate(docs)]
    es.write(rows, tmp_path / "a", "arrow", 40, row_group_size=7, progress=False)
    es.write(rows, tmp_path / "p", "parquet", 40, row_group_size=7, progress=False)
    hf = datasets.Dataset.from_dict(
        {"id": list(range(90)), "input_ids": [d.tolist() for d in docs]}
    )
    hf.shuffle(seed=1).flatten_indices(keep_in_memory=True)
    hf.shuffle(seed=1).save_to_disk(str(tmp_path / "hf"))
    order = rng.permutation(90).tolist()
    for src in (es.from_arrow(tmp_path / "a"), es.from_parquet(tmp_path / "p")):
        got = src.read_tokens(order, "input_ids")
        assert [g.tolist() for g in got] == [docs[i].tolist() for i in order], src
    shuffled = es.from_arrow(tmp_path / "hf")
    ids = [r["id"] for r in shuffled.__getitems__(order)]
    got = shuffled.read_tokens(order, "input_ids")
    assert [g.tolist() for g in got] == [docs[i].tolist() for i in ids]
    assert ids != order  # the mapping is in use


def test_read_tokens_names_a_null_document_and_a_missing_column(tmp_path: Path) -> None:
    table = pa.table({"input_ids": pa.array([[1, 2], None, [3]], pa.list_(pa.int32()))})
    (tmp_path / "n").mkdir()
    pq.write_table(table, tmp_path / "n" / "x.parquet")
    src = es.from_parquet(tmp_path / "n")
    assert src.read_tokens([0], "input_ids")[0].tolist() == [1, 2]
    with pytest.raises(ValueError, match=r"sample 1 .*x\.parquet row 1.*holds a null"):
        src.read_tokens([0, 1], "input_ids")
    with pytest.raises(ValueError, match=r"column 'tokens', which is not in the schema"):
        src.read_tokens([0], "tokens")
