"""Packed sequences through evenly.Dataset(pack=...) and evenly.DataLoader: every token of
every document exactly once per epoch, the same rows whatever the ranks, workers or batch
size, every rank the same number of full-shape batches, exact resume onto another
topology in a fresh process, training by steps, and the refusals.

Documents hold tokens that name them: document ``i``'s token ``t`` is ``1000 * (i + 1) + t``,
so a row's tokens say which document and offset they are, and pad_id 0 is never used.
"""

from __future__ import annotations

import json
import warnings
from collections import Counter
from typing import Any

import numpy as np
import pytest
import torch

import evenly
from tests.distributed import in_fresh_process, run_ranks

#: pad rows are reported by a warning at every pass start (asserted in its own test)
pytestmark = pytest.mark.filterwarnings("ignore:evenly.*pad row:evenly.EvenlyWarning")
SEQ = 16
LENGTHS = [int(n) for n in np.random.default_rng(7).integers(1, 40, size=61)]  # some > SEQ


def docs(lengths: list[int] = LENGTHS) -> list[list[int]]:
    return [[1000 * (i + 1) + t for t in range(n)] for i, n in enumerate(lengths)]


def all_tokens(lengths: list[int] = LENGTHS) -> Counter[int]:
    return Counter(t for d in docs(lengths) for t in d)


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EVENLY_CACHE_DIR", str(tmp_path / "cache"))


#: best_fit settings under which the epochs of the corpus pack into 87, 86, 88 rows
VARIED = {"open_rows": 2, "window": 16}


def dataset(strategy: str, rank: int = 0, world_size: int = 1, **kwargs: Any) -> evenly.Dataset:
    varied = VARIED if kwargs.pop("varied", False) else {}
    pack = evenly.Packing(SEQ, strategy=strategy, document_ids=True, **varied)
    return evenly.Dataset(
        docs(), shuffle=True, seed=3, rank=rank, world_size=world_size, pack=pack, **kwargs
    )


def rows_of(batches: list[dict[str, torch.Tensor]]) -> list[list[int]]:
    return [row for b in batches for row in b["input_ids"].tolist()]


def reference(strategy: str, epoch: int = 0, varied: bool = False) -> list[list[int]]:
    """The epoch's rows as one process reads them (batch 1, no workers)."""
    loader = evenly.DataLoader(dataset(strategy, varied=varied), batch_size=1)
    loader.set_epoch(epoch)
    return rows_of(list(loader))


def interleave(per_rank: list[list[list[int]]], batch_size: int) -> list[list[int]]:
    """Global order of rows from per-rank rows: step s is rank 0's batch s, rank 1's ..."""
    out = []
    steps = max(len(r) for r in per_rank) // batch_size + 1
    for s in range(steps):
        for rows in per_rank:
            out.extend(rows[s * batch_size : (s + 1) * batch_size])
    return out


def real(rows: list[list[int]]) -> list[list[int]]:
    return [r for r in rows if any(r)]


@pytest.mark.parametrize("strategy", ["concat", "best_fit"])
def test_every_token_once_same_rows_for_every_topology_and_full_batches(strategy):
    ref = reference(strategy)
    tokens = Counter(t for row in ref for t in row if t)
    assert tokens == all_tokens()  # every token of every document, exactly once
    assert all(len(row) == SEQ for row in ref)
    for world, workers, batch in [(2, 2, 3), (3, 0, 2)]:
        per_rank, counts = [], set()
        for rank in range(world):
            loader = evenly.DataLoader(
                dataset(strategy, rank, world), batch_size=batch, num_workers=workers
            )
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", evenly.EvenlyWarning)  # pad rows, reported
                batches = list(loader)
            assert all(b["input_ids"].shape == (batch, SEQ) for b in batches)
            counts.add(len(batches))
            assert len(loader) == len(batches)
            per_rank.append(rows_of(batches))
        assert len(counts) == 1  # every rank the same number of full batches
        glob = interleave(per_rank, batch)
        assert real(glob) == ref  # the same rows, in the same global order
        assert len(glob) % (world * batch) == 0 and not any(any(r) for r in glob[len(ref) :])


def test_pad_rows_are_reported_and_marked():
    ds = dataset("concat", 0, 2)
    loader = evenly.DataLoader(ds, batch_size=4)
    with pytest.warns(evenly.EvenlyWarning, match="pad row"):
        batches = list(loader)
    plan = loader.plan
    assert plan.num_padded == plan.num_batches * 8 - plan.num_samples > 0
    last = batches[-1]
    pad = last["input_ids"].sum(dim=1) == 0
    assert pad.any()
    assert (last["labels"][pad] == -100).all() and (last["position_ids"][pad] == 0).all()
    assert (last["document_ids"][pad] == 0).all()


def test_labels_positions_and_cu_seqlens():
    pack = evenly.Packing(SEQ, cu_seqlens=True, document_ids=True)
    loader = evenly.DataLoader(evenly.Dataset(docs(), pack=pack), batch_size=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", evenly.EvenlyWarning)
        batch = next(iter(loader))
    ids, pos, lab, doc = (batch[k] for k in ("input_ids", "position_ids", "labels", "document_ids"))
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[:, 1:] = doc[:, 1:] != doc[:, :-1]
    assert ((pos == 0) == (starts | (ids == 0))).all()  # 0 at row and piece starts
    assert (lab == torch.where((pos == 0) | (ids == 0), -100, ids)).all()
    flat = pos.reshape(-1)
    expected = torch.cat([torch.nonzero(flat == 0).reshape(-1), torch.tensor([flat.numel()])])
    assert batch["cu_seqlens"].dtype == torch.int32
    assert batch["cu_seqlens"].tolist() == expected.tolist()
    assert batch["max_seqlen"] == int((expected[1:] - expected[:-1]).max())


def _resume_tails(states: dict[str, dict], world: int, workers: int, batch: int) -> dict:
    """In a fresh process: load each strategy's state under another topology, read the
    rest of the epoch on every rank."""
    tails = {}
    for strategy, state in states.items():
        per_rank = []
        for rank in range(world):
            loader = evenly.DataLoader(
                dataset(strategy, rank, world), batch_size=batch, num_workers=workers
            )
            loader.load_state_dict(state)
            per_rank.append(rows_of(list(loader)))
        tails[strategy] = per_rank
    return tails


def test_resume_mid_epoch_in_a_fresh_process_onto_another_topology():
    refs, states = {}, {}
    for strategy in ("concat", "best_fit"):
        refs[strategy] = ref = reference(strategy, epoch=1)
        before = []
        for rank in range(2):  # world 2, batch 3, 2 workers; stop after 2 batches
            loader = evenly.DataLoader(dataset(strategy, rank, 2), batch_size=3, num_workers=2)
            loader.set_epoch(1)
            it = iter(loader)
            before.append(rows_of([next(it), next(it)]))
            state = json.loads(json.dumps(loader.state_dict()))
        assert state["position"] == 12 and state["seq_len"] == SEQ and state["unit"] == "rows"
        assert interleave(before, 3) == ref[:12]
        states[strategy] = state
    tails = in_fresh_process(_resume_tails, states, 3, 1, 2)  # world 3, 1 worker, batch 2
    for strategy, per_rank in tails.items():
        assert len({len(r) for r in per_rank}) == 1
        assert real(interleave(per_rank, 2)) == refs[strategy][12:]  # none lost or repeated


def test_a_late_resume_counts_rows_not_documents():
    ref = reference("concat")
    assert len(ref) > len(LENGTHS)  # more rows than documents
    loader = evenly.DataLoader(dataset("concat"), batch_size=2)
    it = iter(loader)
    head = rows_of([next(it) for _ in range(len(LENGTHS) // 2 + 3)])
    fresh = evenly.DataLoader(dataset("concat"), batch_size=5)
    fresh.load_state_dict(json.loads(json.dumps(loader.state_dict())))
    assert fresh.state_dict()["position"] == len(head) > len(LENGTHS)
    assert real(head + rows_of(list(fresh))) == ref


def _packed_stream(strategy: str, world: int, batch: int, steps: int, state=None):
    per_rank, states = [], []
    for rank in range(world):
        ds = dataset(strategy, rank, world, varied=True)
        loader = evenly.DataLoader(ds, batch_size=batch, infinite=True)
        if state is not None:
            loader.load_state_dict(state)
        it = iter(loader)
        per_rank.append(rows_of([next(it) for _ in range(steps)]))
        states.append(loader.state_dict())
    return per_rank, states


@pytest.mark.parametrize("strategy", ["concat", "best_fit"])
def test_infinite_packing_every_epoch_once_and_resume_by_step(strategy):
    """Steps over three epochs (under best_fit each of its own row count), resumed at an
    epoch boundary's other side onto another world size and batch size."""
    epochs = [reference(strategy, e, varied=True) for e in range(3)]
    if strategy == "best_fit":
        assert len({len(rows) for rows in epochs}) == 3  # epochs of different lengths
    per_rank, states = _packed_stream(strategy, 2, 2, 25)  # 100 rows: into epoch 1
    first = interleave(per_rank, 2)[:100]
    assert states[0] == states[1]
    assert (states[0]["epoch"], states[0]["position"]) == (1, 100 - len(epochs[0]))
    rest, _ = _packed_stream(strategy, 1, 4, 36, json.loads(json.dumps(states[0])))
    stream = first + interleave(rest, 4)[:144]
    whole = [row for rows in epochs for row in rows]
    assert len(epochs[0]) + len(epochs[1]) < len(stream) <= len(whole)
    assert stream == whole[: len(stream)]  # no pad rows, every epoch once, in order


def test_best_fit_len_is_true_every_epoch_and_documents_that_fit_stay_whole():
    loader = evenly.DataLoader(dataset("best_fit"), batch_size=2)
    for _ in range(2):
        expected = len(loader)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", evenly.EvenlyWarning)
            batches = list(loader)
        assert len(batches) == expected
        for row, doc in zip(
            rows_of(batches), [r for b in batches for r in b["document_ids"].tolist()], strict=True
        ):
            for d in set(doc) - {0}:
                n = LENGTHS[d - 1]
                if n <= SEQ:  # a document that fits is in one row, whole
                    assert [t for t in row if t // 1000 == d] == docs()[d - 1]


def test_drop_last_and_pad_none():
    full = reference("concat")
    ds = dataset("concat", 0, 2, drop_last=True)
    loader = evenly.DataLoader(ds, batch_size=3)
    assert loader.plan.num_dropped == len(full) % 6 and loader.plan.num_dropped > 0
    assert len(list(loader)) == len(full) // 6
    per_rank = []
    for rank in range(2):
        loader = evenly.DataLoader(dataset("concat", rank, 2, pad="none"), batch_size=3)
        per_rank.append(rows_of(list(loader)))
    rows = [r for rank_rows in per_rank for r in rank_rows]
    assert all(any(r) for r in rows) and len(rows) == len(full)  # no pad rows at all


def _seeded(doc: dict[str, Any]) -> dict[str, Any]:
    shift = int(np.random.randint(1, 5))
    return {"input_ids": [t + shift for t in doc["input_ids"]]}


def test_transform_runs_per_document_seeded_whatever_the_workers():
    source = [{"input_ids": d} for d in docs()]

    def rows(workers: int, context: str | None = None) -> list[list[int]]:
        ds = evenly.Dataset(
            source, shuffle=True, seed=1, transform=_seeded, pack=evenly.Packing(SEQ)
        )
        loader = evenly.DataLoader(
            ds, batch_size=2, num_workers=workers, multiprocessing_context=context
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", evenly.EvenlyWarning)
            return rows_of(list(loader))

    one = rows(0)
    assert rows(2, "spawn") == one
    shifted = Counter(t for r in one for t in r if t)
    assert shifted != all_tokens() and sum(shifted.values()) == sum(LENGTHS)


def _tokenize(texts: list[str]) -> list[list[int]]:
    return [[ord(c) for c in text] for text in texts]


def test_tokenize_hook_packs_text_documents():
    texts = [f"doc{i}:" + "x" * (i % 23) for i in range(30)]
    pack = evenly.Packing(SEQ, tokenize=_tokenize, tokenizer_id="ord-v1")
    loader = evenly.DataLoader(evenly.Dataset(texts, pack=pack), batch_size=2, num_workers=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", evenly.EvenlyWarning)
        rows = rows_of(list(loader))
    stream = [t for row in rows for t in row if t]
    assert stream == [t for ids in _tokenize(texts) for t in ids]


def test_arrow_and_parquet_lengths_from_list_offsets_cached(tmp_path):
    import os

    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table(
        {"input_ids": pa.array(docs(), type=pa.list_(pa.int32())), "n": list(range(len(LENGTHS)))}
    )
    pq.write_table(table, tmp_path / "d.parquet", row_group_size=17)
    source = evenly.from_parquet(str(tmp_path / "d.parquet"))
    assert source.token_lengths("input_ids").tolist() == LENGTHS
    with pytest.raises(TypeError, match="not a list"):
        source.token_lengths("n")
    pack = evenly.Packing(SEQ, strategy="best_fit", document_ids=True)
    ds = evenly.Dataset(source, shuffle="global", seed=3, pack=pack)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", evenly.EvenlyWarning)
        rows = rows_of(list(evenly.DataLoader(ds, batch_size=1)))
    assert rows == reference("best_fit")  # the same rows as the in-memory documents
    assert len(os.listdir(tmp_path / "cache" / "lengths")) >= 1


def test_packing_keeps_its_lengths_and_plans_in_the_sources_cache_dir(tmp_path):
    """A source given ``cache_dir=`` holds packing's lengths and plans there (its
    workers' too), not in the default cache directory."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"input_ids": docs()}), tmp_path / "d.parquet", row_group_size=17)
    given = tmp_path / "given"
    source = evenly.from_parquet(str(tmp_path / "d.parquet"), cache_dir=str(given))
    pack = evenly.Packing(SEQ, strategy="best_fit", document_ids=True)
    loader = evenly.DataLoader(
        evenly.Dataset(source, shuffle=True, seed=3, pack=pack), batch_size=4, num_workers=2
    )
    for epoch in range(2):
        loader.set_epoch(epoch)
        assert sorted(Counter(t for r in rows_of(list(loader)) for t in r if t)) == sorted(
            all_tokens()
        )
    assert len(list((given / "lengths").glob("*.i32"))) == 1
    assert {p.name.rsplit("-", 1)[1] for p in (given / "packing").glob("*.best_fit")} == {
        "e0.best_fit",
        "e1.best_fit",
    }
    default = tmp_path / "cache"  # $EVENLY_CACHE_DIR
    assert not (default / "lengths").exists() and not (default / "packing").exists()


def test_refusals_name_the_setting_and_the_document():
    with pytest.raises(ValueError, match="on_error='skip'"):
        dataset("concat", on_error="skip")
    with pytest.raises(ValueError, match="pad='mask'"):
        dataset("concat", pad="mask", transform=lambda d: d)
    mix = evenly.Mix({"a": docs(), "b": docs()})
    with pytest.raises(ValueError, match="unit='tokens'"):
        evenly.Dataset(mix, pack=evenly.Packing(SEQ))
    bad = docs()
    bad[5] = [*bad[5][:2], 0, *bad[5][2:]]
    ds = evenly.Dataset(bad, pack=evenly.Packing(SEQ, pad_id=0))
    with pytest.raises(ValueError, match=r"document 5 .*pad_id=0"):
        list(evenly.DataLoader(ds, batch_size=2))
    grow = evenly.Dataset(docs(), transform=lambda d: [*d, 7], pack=evenly.Packing(SEQ))
    with pytest.raises(ValueError, match=r"document 0 .* token count"):
        list(evenly.DataLoader(grow, batch_size=2))
    packed_state = evenly.DataLoader(dataset("concat")).state_dict()
    with pytest.raises(evenly.StateError, match="seq_len"):
        other = evenly.DataLoader(evenly.Dataset(docs(), pack=evenly.Packing(8)))
        other.load_state_dict(packed_state)
    with pytest.raises(evenly.StateError, match="unit: saved 'rows', dataset has None"):
        plain = evenly.DataLoader(evenly.Dataset(docs(), shuffle=True, seed=3))
        plain.load_state_dict(packed_state)


def _ddp_rows(rank: int, world_size: int) -> dict[str, list[list[int]]]:
    out = {}
    for strategy in ("concat", "best_fit"):  # one launch for both (each: its own pass)
        pack = evenly.Packing(SEQ, strategy=strategy, document_ids=True)
        ds = evenly.Dataset(docs(), shuffle=True, seed=3, pack=pack)
        loader = evenly.DataLoader(ds, batch_size=2, num_workers=2)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", evenly.EvenlyWarning)
            out[strategy] = rows_of(list(loader))
    return out


def test_real_gloo_ranks_read_the_one_process_rows(tmp_path):
    env = {"EVENLY_CACHE_DIR": str(tmp_path / "ddp-cache")}
    per_rank = run_ranks(_ddp_rows, 2, env=env)
    for strategy in ("concat", "best_fit"):
        rows = [r[strategy] for r in per_rank]
        assert len({len(r) for r in rows}) == 1
        assert real(interleave(rows, 2)) == reference(strategy)


def test_hf_datasets_lengths_honour_the_indices_mapping(tmp_path):
    datasets = pytest.importorskip("datasets")
    hf = datasets.Dataset.from_dict({"input_ids": docs()})
    hf.save_to_disk(str(tmp_path / "hf"))
    picked = datasets.load_from_disk(str(tmp_path / "hf")).select(range(60, -1, -2))
    source = evenly.from_arrow(picked)
    assert source.token_lengths("input_ids").tolist() == LENGTHS[60::-2]
    ds = evenly.Dataset(source, pack=evenly.Packing(SEQ))
    stream = [t for row in rows_of(list(evenly.DataLoader(ds, batch_size=4))) for t in row]
    assert [t for t in stream if t] == [t for d in docs()[60::-2] for t in d]


def test_a_plain_torch_dataloader_reads_packed_rows_once():
    ds = dataset("best_fit")
    loader = torch.utils.data.DataLoader(ds, batch_size=4, num_workers=2)
    batches = list(loader)
    rows = rows_of(batches)
    assert len(ds) == len(rows) and sorted(real(rows)) == sorted(reference("best_fit"))


def test_old_epochs_plans_are_pruned_and_planned_again_when_replayed(tmp_path):
    first = reference("best_fit", epoch=0)
    loader = evenly.DataLoader(dataset("best_fit"), batch_size=8)
    for _ in range(4):
        list(loader)
    plans = sorted(p.name for p in (tmp_path / "cache" / "packing").glob("*.best_fit"))
    assert [name.rsplit("-", 1)[1] for name in plans] == ["e2.best_fit", "e3.best_fit"]
    loader.set_epoch(0)
    assert real(rows_of(list(loader))) == first
