"""Misconfiguration and bad sources are caught with clear errors, never suffered."""

from __future__ import annotations

import os
from typing import Any

import pytest

import evenly
from evenly import EvenlyWarning
from evenly.errors import PlanMismatchError
from evenly.runtime.agreement import disagreements
from tests.distributed import run_ranks


def view(**changes: Any) -> dict[str, Any]:
    base = {
        "num_samples": 100,
        "seed": 0,
        "shuffle": "global",
        "drop_last": False,
        "batch_size": 8,
        "epoch": 0,
        "start": 0,
        "world_size": 3,
    }
    return {**base, **changes}


def test_disagreements_name_each_field_and_the_ranks() -> None:
    views = [view(rank=0), view(rank=1, seed=5), view(rank=2, num_samples=99, seed=5)]
    problems = disagreements(views)
    assert "seed: rank 0 has 0; ranks 1, 2 have 5" in problems
    assert "num_samples: ranks 0, 1 have 100; rank 2 has 99" in problems
    assert len(problems) == 2
    assert disagreements([view(rank=r) for r in range(3)]) == []
    clash = disagreements([view(rank=0), view(rank=0), view(rank=2)])
    assert any("claim data ranks [0, 0, 2]" in p for p in clash)


def mismatched_seed(rank: int, world: int, check: bool) -> str:
    ds = evenly.Dataset(list(range(64)), shuffle=True, seed=rank)  # a bug: seed per rank
    loader = evenly.DataLoader(ds, batch_size=4, agreement_timeout=30 if check else None)
    try:
        next(iter(loader))
    except PlanMismatchError as exc:
        return str(exc)
    return "no error"


def test_ranks_that_disagree_all_raise_the_same_clear_error() -> None:
    messages = run_ranks(mismatched_seed, 2, True)
    assert messages[0] == messages[1]
    assert "seed: rank 0 has 0; rank 1 has 1" in messages[0]
    assert "agreement_timeout=None" in messages[0]
    assert run_ranks(mismatched_seed, 2, False) == ["no error", "no error"]


def same_explicit_rank(rank: int, world: int) -> str:
    ds = evenly.Dataset(list(range(64)), rank=0, world_size=2)  # a bug: rank hard-coded
    try:
        next(iter(evenly.DataLoader(ds, batch_size=4)))
    except PlanMismatchError as exc:
        return str(exc)
    return "no error"


def test_two_processes_claiming_the_same_rank_are_caught() -> None:
    messages = run_ranks(same_explicit_rank, 2)
    assert all("claim data ranks [0, 0]" in m for m in messages)


class Flaky:
    """A source whose samples in ``broken`` cannot be read, with a file/row location."""

    def __init__(self, n: int, broken: set[int]) -> None:
        self.n, self.broken = n, broken

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if i in self.broken:
            raise ValueError(f"corrupt record {i}")
        return i

    def locate(self, i: int) -> str:
        return f"shard-{i // 10:03d}.bin row {i % 10}"


@pytest.mark.parametrize("workers", [0, 2])
def test_an_unreadable_sample_names_index_and_file(workers: int) -> None:
    ds = evenly.Dataset(Flaky(40, {23}), shuffle=True)
    loader = evenly.DataLoader(ds, batch_size=4, num_workers=workers)
    with pytest.raises(ValueError, match="corrupt record 23") as info:
        list(loader)
    text = str(info.value) + " ".join(getattr(info.value, "__notes__", []))
    assert "sample 23" in text and "shard-002.bin row 3" in text
    if workers:  # the worker's original traceback comes along
        assert "in __getitem__" in text


@pytest.mark.parametrize("workers", [0, 2])
def test_on_error_skip_replaces_and_reports_keeping_batch_counts(workers: int) -> None:
    broken = {3, 17, 31}
    counts, seen = [], []
    for rank in range(2):
        ds = evenly.Dataset(
            Flaky(40, broken), shuffle=True, on_error="skip", rank=rank, world_size=2
        )
        loader = evenly.DataLoader(ds, batch_size=4, num_workers=workers)
        with pytest.warns(EvenlyWarning, match=r"replaced \d unreadable sample"):
            batches = [b.tolist() for b in loader]
        counts.append([len(b) for b in batches])
        seen += [x for b in batches for x in b]
        plan = loader.plan
        mine = plan.indices(plan.rank_positions(rank)).tolist()
        assert loader.num_skipped == sum(1 for x in mine if x in broken)
    assert counts[0] == counts[1] == [4] * 5
    assert not broken & set(seen) and len(seen) == 40
    assert set(range(40)) - broken <= set(seen)


class LyingLength:
    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int) -> int:
        return list(range(8))[i]


def test_a_source_whose_len_lies_gets_a_clear_error() -> None:
    loader = evenly.DataLoader(evenly.Dataset(LyingLength()), batch_size=4)
    with pytest.raises(IndexError, match=r"len\(source\) = 10: its __len__ promises more"):
        list(loader)


class Growing:
    def __init__(self) -> None:
        self.n = 8

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def test_a_length_change_between_epochs_is_reported() -> None:
    source = Growing()
    loader = evenly.DataLoader(evenly.Dataset(source), batch_size=4)
    assert len(list(loader)) == 2
    source.n = 12
    with pytest.warns(EvenlyWarning, match="had 8 samples last epoch and has 12 now"):
        assert len(list(loader)) == 3


class ChangesInWorkers:
    """Reports another length inside DataLoader workers (as a file appended to would)."""

    def __init__(self) -> None:
        self.owner = os.getpid()

    def __len__(self) -> int:
        return 16 if os.getpid() == self.owner else 20

    def __getitem__(self, i: int) -> int:
        return i


def test_a_length_change_during_an_epoch_is_an_error() -> None:
    loader = evenly.DataLoader(evenly.Dataset(ChangesInWorkers()), batch_size=4, num_workers=2)
    with pytest.raises(RuntimeError, match=r"the source changed .* len\(source\) is \d+ here"):
        list(loader)


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (
            lambda: evenly.DataLoader(evenly.Dataset([1]), batch_size=0),
            ValueError,
            "batch_size must be >= 1, got 0",
        ),
        (
            lambda: evenly.DataLoader(evenly.Dataset([1]), batch_size=-2),
            ValueError,
            "batch_size must be >= 1, got -2",
        ),
        (lambda: evenly.Dataset([1], world_size=0), ValueError, "world_size must be >= 1, got 0"),
        (
            lambda: evenly.Dataset([1], rank=4, world_size=4),
            ValueError,
            r"rank 4 is out of range for world_size 4: rank must lie in \[0, 3\]",
        ),
        (lambda: evenly.Dataset([1], rank=-1), ValueError, "rank must be >= 0, got -1"),
        (lambda: evenly.Dataset([1], seed=0.5), TypeError, "seed must be an integer, got 0.5"),
        (
            lambda: evenly.Dataset([1], shuffle="yes"),
            ValueError,
            "shuffle must be True, False, 'global' or 'block', got 'yes'",
        ),
        (
            lambda: evenly.Dataset([1], shuffle="block"),
            ValueError,
            "shuffle='block' needs a sharded source",
        ),
        (
            lambda: evenly.Dataset([1], on_error="ignore"),
            ValueError,
            "on_error must be 'raise' or 'skip', got 'ignore'",
        ),
    ],
)
def test_bad_settings_get_clear_messages(make: Any, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        make()


def test_bad_torchrun_variables_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(ValueError, match="WORLD_SIZE='two' is not an integer"):
        evenly.Dataset([1, 2]).topology()
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(ValueError, match="rank 2 is out of range for world_size 2"):
        len(evenly.Dataset([1, 2]))


def whole_dataset_on_each_rank(rank: int, world: int) -> int:
    # deliberately not split over the group (e.g. every rank evaluates everything)
    ds = evenly.Dataset(list(range(16)), rank=0, world_size=1)
    return sum(len(b) for b in evenly.DataLoader(ds, batch_size=4))


def test_a_plan_not_split_over_the_group_is_not_checked_against_it() -> None:
    assert run_ranks(whole_dataset_on_each_rank, 2) == [16, 16]
