"""The dataset's own passes under loaders that are not evenly's: every pass is whole and
read once per epoch, even when two loaders read one dataset in turns, and a checkpoint
that cannot know what the loop received says so instead of guessing."""

from __future__ import annotations

import json
import warnings
from collections import Counter
from typing import Any

import pytest
import torch
import torch.utils.data as tud

import evenly

N = 101


def ids(batches: list[Any]) -> list[int]:
    return [int(x) for b in batches for x in b]


def _quiet() -> warnings.catch_warnings[None]:
    caught = warnings.catch_warnings()
    caught.__enter__()
    warnings.simplefilter("ignore", evenly.EvenlyWarning)
    return caught


@pytest.mark.slow
@pytest.mark.parametrize(
    ("context", "persistent"), [("fork", False), ("fork", True), ("spawn", True)]
)
def test_two_plain_loaders_over_one_dataset_each_read_whole_passes(
    context: str, persistent: bool
) -> None:
    """Training with 2 workers, and every 5 batches an evaluation pass over the same
    dataset with 3 workers: each training epoch and each evaluation pass is every sample
    once, and the training epochs still differ: no loader's workers advance another
    loader's pass."""
    ds = evenly.Dataset(list(range(N)), shuffle=True, seed=4)
    kw: dict[str, Any] = {"multiprocessing_context": context, "persistent_workers": persistent}
    train = tud.DataLoader(ds, batch_size=4, num_workers=2, **kw)
    evaluation = tud.DataLoader(ds, batch_size=8, num_workers=3, **kw)
    caught = _quiet()
    try:
        epochs, evals = [], []
        for _ in range(3):
            got: list[int] = []
            for step, batch in enumerate(train):
                got.extend(int(x) for x in batch)
                if step % 5 == 4:
                    evals.append(ids(list(evaluation)))
            epochs.append(got)
    finally:
        caught.__exit__(None, None, None)
    for got in [*epochs, *evals]:
        assert Counter(got) == Counter(range(N)), "every sample exactly once"
    assert len({tuple(e) for e in epochs}) == 3, "each training epoch is a new shuffle"
    assert len(evals) == 3 * (len(train) // 5)


def test_the_workers_of_one_pass_agree_on_its_epoch_whatever_ran_between() -> None:
    """A persistent loader's pass keeps its epoch for all its workers although another
    loader's pass started (and took the next epoch) while it ran."""
    ds = evenly.Dataset(list(range(40)), shuffle=True, seed=2)
    first = tud.DataLoader(ds, batch_size=2, num_workers=2, persistent_workers=True)
    second = tud.DataLoader(ds, batch_size=2, num_workers=2, persistent_workers=True)
    caught = _quiet()
    try:
        a = iter(first)
        head = [next(a) for _ in range(3)]
        other = ids(list(second))  # a whole pass of another loader in between
        rest = list(a)
    finally:
        caught.__exit__(None, None, None)
    assert sorted(ids(head + rest)) == list(range(40))
    assert sorted(other) == list(range(40))
    assert ids(head + rest) != other, "the two passes are two epochs"


def test_state_dict_under_plain_workers_needs_the_samples_received() -> None:
    """Under a plain DataLoader with workers the dataset cannot count what the loop
    received (workers read ahead): the default state_dict() raises naming the argument;
    given it (a multiple of workers x batch size, as documented), it resumes exactly."""
    ds = evenly.Dataset(list(range(N)), shuffle=True, seed=9)
    loader = tud.DataLoader(ds, batch_size=5, num_workers=2)
    caught = _quiet()
    try:
        it = iter(loader)
        head = [next(it) for _ in range(6)]
        with pytest.raises(evenly.StateError, match="samples_received"):
            ds.state_dict()
        state = json.loads(json.dumps(ds.state_dict(samples_received=30)))
        del it
        fresh = evenly.Dataset(list(range(N)), shuffle=True, seed=9)
        fresh.load_state_dict(state)
        rest = ids(list(tud.DataLoader(fresh, batch_size=5, num_workers=3)))
    finally:
        caught.__exit__(None, None, None)
    assert Counter(ids(head) + rest) == Counter(range(N))


def test_zero_worker_loaders_share_the_main_process_passes() -> None:
    """With num_workers=0 every iter() over the dataset is its next pass, whichever
    loader makes it (documented); each pass is whole."""
    ds = evenly.Dataset(list(range(12)), shuffle=True, seed=1)
    a = tud.DataLoader(ds, batch_size=3)
    b = tud.DataLoader(ds, batch_size=4)
    passes = [ids(list(a)), ids(list(b)), ids(list(a))]
    assert all(sorted(p) == list(range(12)) for p in passes)
    assert ds.epoch == 3  # the next pass: the three passes ended
    assert torch.equal(torch.tensor(passes[0]), torch.tensor(ids(list(_replay(ds, 0)))))


def _replay(ds: evenly.Dataset[Any], epoch: int) -> list[Any]:
    ds.set_epoch(epoch)
    return list(tud.DataLoader(ds, batch_size=6))
