"""HF Accelerate and the HF Trainer over evenly, in real 2-rank gloo runs.

A user hands ``evenly.DataLoader`` to ``accelerator.prepare`` (or an ``evenly.Dataset`` to
a Trainer with evenly's ``TrainerMixin``) and changes nothing else.  The guarantees must
hold through Accelerate's rebuilt loader: every sample exactly once per epoch across the
ranks, equal batch counts, a new order each epoch, and an exact mid-epoch resume in a
fresh run through ``save_state``/``load_state``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.distributed import run_ranks
from tests.interop_scripts import accelerate_ranks, hf_trainer_ranks
from tests.interop_scripts.expect import (
    assert_equal_batches,
    assert_exactly_once,
    assert_order_changes,
    join,
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("accelerate") is None, reason="needs accelerate (test extra)"
    ),
]

WORLD = 2
NS = (1000, 1001)
QUIET = {"PYTHONWARNINGS": "ignore", "ACCELERATE_LOG_LEVEL": "error"}


def check_two_epochs(results: list[dict[int, dict[str, object]]], what: str) -> None:
    for n in NS:
        per_rank = [r[n] for r in results]
        epochs = [[r["epochs"][e] for r in per_rank] for e in range(2)]  # type: ignore[index]
        for e, epoch in enumerate(epochs):
            label = f"{what}, N={n}, epoch {e}"
            assert_exactly_once(epoch, n, WORLD, label)
            assert_equal_batches(epoch, label)
            lens = {r["lens"][e] for r in per_rank}  # type: ignore[index]
            assert lens == {len(epoch[0])}, f"{label}: len(loader) {lens}, {len(epoch[0])} came"
        assert_order_changes(epochs[0], epochs[1], f"{what}, N={n}")


def test_accelerate_prepare_default_delivers_every_sample_once_per_epoch() -> None:
    results = run_ranks(accelerate_ranks.train, WORLD, NS, None, 2, env=QUIET, timeout=150)
    check_two_epochs(results, "accelerate prepare() default")


def test_accelerate_without_dispatch_delivers_every_sample_once_per_epoch() -> None:
    results = run_ranks(accelerate_ranks.train, WORLD, NS, False, 2, env=QUIET, timeout=150)
    check_two_epochs(results, "accelerate dispatch_batches=False")


@pytest.mark.parametrize("skip", [False, True])
def test_accelerate_save_state_mid_epoch_resumes_exactly_in_a_fresh_run(
    tmp_path: Path, skip: bool
) -> None:
    """load_state, then the loader itself, or (skip) Accelerate's documented
    ``skip_first_batches(loader, steps)`` over it: the rest once, not skipped twice."""
    steps = 20
    ckpt = str(tmp_path / "ckpt")
    first = run_ranks(accelerate_ranks.train_then_save, WORLD, NS, steps, ckpt, env=QUIET)
    second = run_ranks(
        accelerate_ranks.load_then_train, WORLD, NS, ckpt, steps if skip else 0, env=QUIET
    )
    for n in NS:
        before = [r[n] for r in first]
        rest, epoch1 = ([r[n][e] for r in second] for e in range(2))
        label = f"accelerate save_state/load_state, N={n}"
        assert_equal_batches(rest, f"{label}, rest of epoch 0")
        assert_exactly_once(join(before, rest), n, WORLD, f"{label}, epoch 0 (both runs)")
        assert_exactly_once(epoch1, n, WORLD, f"{label}, epoch 1")
        assert_equal_batches(epoch1, f"{label}, epoch 1")
        assert_order_changes(join(before, rest), epoch1, label)


def test_hf_trainer_over_evenly_dataset_delivers_every_sample_once_or_names_the_mixin(
    tmp_path: Path,
) -> None:
    """With evenly's TrainerMixin, every sample once in exactly the steps of an epoch.
    The Trainer alone counts its steps with len() before the first pass, which evenly
    answers without looking at the caller (this rank's share, while Accelerate's
    dispatcher has rank 0 read the whole epoch): over the bare evenly.Dataset and over the
    user's own wrapper of it (boundaries hole 1), the first batch raises, naming the mixin.
    One launch."""
    kinds = ("mixin", "plain", "wrapped")
    results = run_ranks(
        hf_trainer_ranks.train, WORLD, NS, str(tmp_path), kinds, env=QUIET, timeout=240
    )
    for n in NS:
        label = f"HF Trainer with TrainerMixin over evenly.Dataset, N={n}"
        epoch = [r["mixin", n] for r in results]
        assert_exactly_once(epoch, n, WORLD, label)
        assert_equal_batches(epoch, label)
        steps = -(-n // (WORLD * 10))
        assert len(epoch[0]) == steps, f"{label}: {len(epoch[0])} steps, not {steps}"
        for kind in ("plain", "wrapped"):
            for said in (r[kind, n] for r in results):
                assert isinstance(said, str), f"{kind}, N={n}: trained without an error"
                assert "asked before its pass" in said and "TrainerMixin" in said, said
                assert "after" not in said, f"{kind}, N={n}: raised after a batch: {said}"


def test_a_prepared_plain_loader_over_the_dataset_is_never_sharded_twice() -> None:
    """A plain DataLoader over evenly.Dataset handed to prepare(), in one launch: the
    DataLoaderDispatcher (default) and the IterableDatasetShard (dispatch_batches=False),
    over the dataset or over a user's wrapper of it (boundaries hole 1); an
    evenly.DataLoader over the dataset after a prepared epoch (hole 2);
    use_stateful_dataloader=True (hole 4: refused with workers, before the first batch;
    exact without)."""
    results = run_ranks(accelerate_ranks.boundaries, WORLD, NS, env=QUIET, timeout=300)
    for key in ("dispatch", "shard"):
        for wrapped in (False, True):
            what = f"prepare(plain DataLoader over {'a wrapper of ' if wrapped else ''}evenly)"
            per_n = [{n: r[key][wrapped, n] for n in NS} for r in results]
            check_two_epochs(per_n, f"{what}, {key}")
    for n in NS:
        after = [r["after"][n] for r in results]
        share = -(-n // WORLD)
        assert [a["len_ds"] for a in after] == [share] * WORLD, "hole 2: len(ds) after prepare"
        assert [a["len"] for a in after] == [-(-share // 10)] * WORLD
        assert [len(a["ids"]) for a in after] == [share] * WORLD, "hole 2: each rank reads all"
        assert_exactly_once([[a["ids"]] for a in after], n, WORLD, f"hole 2, N={n}")
        stateful = [r["stateful"][n] for r in results]
        for s in stateful:
            assert len(s["errors"]) == 1 and "use_stateful_dataloader" in s["errors"][0], s
            assert "inside prepare()" in s["errors"][0] and "evenly.DataLoader" in s["errors"][0]
        epoch = [s["epochs"][0] for s in stateful]
        assert_exactly_once(epoch, n, WORLD, f"stateful without workers, N={n}")
        assert_equal_batches(epoch, f"stateful without workers, N={n}")
        assert {s["lens"][0] for s in stateful} == {len(epoch[0])}


@pytest.mark.parametrize(("n", "own"), [(NS[0], True), (NS[1], True)])
def test_hf_trainer_resumes_mid_epoch_exactly_in_a_fresh_run(
    tmp_path: Path, n: int, own: bool
) -> None:
    """With evenly's TrainerMixin (``get_train_dataloader`` returns an evenly.DataLoader):
    the resume goes through skip_first_batches over that loader.  (The Trainer's own
    loader over two ranks is refused: see the test above.)"""
    steps, per_epoch = 20, -(-n // (WORLD * 10))
    out = str(tmp_path / "run")
    before = run_ranks(
        hf_trainer_ranks.train_then_checkpoint, WORLD, n, steps, out, own, env=QUIET, timeout=150
    )
    checkpoint = str(tmp_path / "run" / f"checkpoint-{steps}")
    after = run_ranks(
        hf_trainer_ranks.resume_two_epochs, WORLD, n, checkpoint, out, own, env=QUIET, timeout=150
    )
    label = f"HF Trainer resume, N={n}, evenly.DataLoader={own}"
    rest = [r[: per_epoch - steps] for r in after]
    epoch1 = [r[per_epoch - steps :] for r in after]
    assert [len(r) for r in before] == [steps] * WORLD
    assert_equal_batches(rest, f"{label}, rest of epoch 0")
    assert_exactly_once(join(before, rest), n, WORLD, f"{label}, epoch 0 (both runs)")
    assert_exactly_once(epoch1, n, WORLD, f"{label}, epoch 1")
    assert_order_changes(join(before, rest), epoch1, label)


def test_gather_for_metrics_over_a_prepared_evenly_loader_counts_every_sample_once() -> None:
    """An evaluation loop gathering each batch's ids with ``gather_for_metrics`` over 2
    real ranks, under the default pad and pad="mask", N = 1000 (no padding), 1001 and
    1013 (one repeat in the last step of 1 and 7 rows per rank): the loader tells
    Accelerate the last batch and its real rows, as Accelerate's own loaders do, so each
    epoch's gathered ids are every sample exactly once, on both ranks, and nothing warns
    that the repeats are kept."""
    ns = (1000, 1001, 1013)
    results = run_ranks(accelerate_ranks.gather_metrics, WORLD, ns, env=QUIET, timeout=240)
    for key, got in results[0].items():
        pad, n = key
        assert results[1][key]["epochs"] == got["epochs"], f"{key}: the ranks gathered alike"
        for e, gathered in enumerate(got["epochs"]):
            assert sorted(gathered) == list(range(n)), f"pad={pad}, N={n}, epoch {e}"
        assert got["epochs"][0] != got["epochs"][1]
        for rank in results:
            said = rank[key]["warnings"]
            assert not [w for w in said if "gather_for_metrics" in w], (key, said)
