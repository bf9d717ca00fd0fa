"""Every loader evenly supports resumes exactly from a state saved after any batch, under
another world size, number of workers or batch size (the checkpoint harness,
``evenly.testing.check_resume``): the interrupted epoch is delivered exactly once in its
global order, the next epoch follows, ``len()`` after a load counts the batches already
received, and the state keeps its shape.

Ranks are simulated in one process (explicit ``rank=``/``world_size=``); workers are real
processes.  With ``num_workers=0`` every batch index of two epochs is a stop; with workers
a few are (the first, middle and last of the first epoch, the boundary, the last one).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

import evenly
from evenly.testing import (
    Layout,
    LengthMismatch,
    Make,
    Rig,
    check_resume,
    evenly_loader,
    sampler_loader,
    stateful_loader,
    torch_loader,
)

pytestmark = [
    pytest.mark.filterwarnings("ignore::evenly.EvenlyWarning"),
    pytest.mark.filterwarnings("ignore:'set_vital' is deprecated"),
]

N = 37  # 2 ranks x batch 4: 4 full steps and a tail of 5, padded by one on 2 ranks
SHUFFLED: dict[str, Any] = {"shuffle": True, "seed": 4}


def numbers() -> list[int]:
    return list(range(N))


def mixture(**kwargs: Any) -> evenly.Mix:
    """Sample ``i`` of the ``d``-th source is ``1000 * d + i``; source "c" (one sample) is
    read seven times an epoch."""
    return evenly.Mix(
        {"a": list(range(23)), "b": list(range(1000, 1007)), "c": [2000]},
        weights={"a": 5, "b": 3, "c": 2},
        samples_per_epoch=N,
        **kwargs,
    )


def stops_of(report_stops: list[int], every_batch: bool, first_epoch: int, total: int) -> None:
    if every_batch:
        assert report_stops == list(range(total))
    else:
        assert report_stops == sorted(
            {0, first_epoch // 2, first_epoch - 1, first_epoch, total - 1}
        )


def run(make: Make, before: Layout, after: Layout, every_batch: bool, **kwargs: Any) -> None:
    report = check_resume(make, before, after, num_samples=N, every_batch=every_batch, **kwargs)
    per_epoch = report.batches_per_epoch
    stops_of(report.stops, every_batch, per_epoch[0], per_epoch[0] + per_epoch[1])


# ---- finite loaders -----------------------------------------------------------------------
STATEFUL_LENGTH = (
    "len(StatefulDataLoader) right after load_state_dict is the new topology's full "
    "epoch (torchdata hands the state to the dataset only when the iterator starts), not "
    "the batches the state records (_num_yielded) + the batches left"
)


def finite(
    make: Make, before: Layout, after: Layout, every_batch: bool, xfail: str = "", **kw: Any
) -> Any:
    marks = [pytest.mark.xfail(strict=True, raises=LengthMismatch, reason=xfail)] if xfail else []
    return pytest.param(make, before, after, every_batch, kw, marks=marks)


FINITE = {
    "evenly-loader": finite(
        evenly_loader(numbers, **SHUFFLED), Layout(2, 0, 4), Layout(3, 0, 5), True
    ),
    "evenly-loader-workers": finite(
        evenly_loader(numbers, **SHUFFLED), Layout(2, 2, 4), Layout(3, 1, 3), False
    ),
    # reader threads: every stop (no process start per resumed rank)
    "evenly-loader-threads": finite(
        evenly_loader(numbers, worker_type="thread", **SHUFFLED),
        Layout(2, 2, 4),
        Layout(3, 3, 3),
        True,
    ),
    "torch-loader": finite(
        torch_loader(numbers, **SHUFFLED), Layout(2, 0, 4), Layout(3, 0, 5), True
    ),
    "batch-sampler": finite(sampler_loader(N, seed=4), Layout(2, 0, 4), Layout(3, 0, 5), True),
    "batch-sampler-workers": finite(
        sampler_loader(N, seed=4), Layout(2, 2, 4), Layout(1, 2, 7), False
    ),
    "stateful-loader": finite(
        stateful_loader(numbers, **SHUFFLED),
        Layout(2, 0, 4),
        Layout(3, 0, 5),
        True,
        xfail=STATEFUL_LENGTH,
    ),
    # torchdata needs the same number of workers; with workers the state is per worker
    "stateful-loader-workers": finite(
        stateful_loader(numbers, **SHUFFLED),
        Layout(2, 2, 4),
        Layout(2, 2, 5),
        False,
        xfail="len(StatefulDataLoader) is ceil(samples per rank / batch size) = 5, but each "
        "of the 2 workers batches its own share of the dataset-owned pass, so a rank gets 6 "
        "batches (two partial); and " + STATEFUL_LENGTH,
    ),
}


@pytest.mark.parametrize(
    ("make", "before", "after", "every_batch", "kw"), FINITE.values(), ids=list(FINITE)
)
def test_a_finite_loader_resumes_exactly_from_every_stop(
    make: Make, before: Layout, after: Layout, every_batch: bool, kw: dict[str, Any]
) -> None:
    run(make, before, after, every_batch, samples=range(N), **kw)


def test_stateful_loader_with_workers_refuses_another_world_size() -> None:
    """StatefulDataLoader with workers saves each worker's progress through its share of
    the old layout: loaded under another world size, that count would skip the wrong
    samples, so the worker raises evenly's StateError naming both world sizes."""
    with pytest.raises(evenly.StateError, match=r"world_size=2 cannot resume under world_size=3"):
        run(stateful_loader(numbers, **SHUFFLED), Layout(2, 2, 4), Layout(3, 2, 4), False)


@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="a state StatefulDataLoader (num_workers=0) takes after an epoch's last batch, "
    "when that batch is full, has fetcher_ended=False and _num_yielded=5 beside evenly's "
    "dataset_state pointing at the next epoch: the restored iterator yields the whole next "
    "epoch as the rest of the finished one (with a partial last batch the rest is empty, "
    "torchdata's convention, as with workers)",
)
def test_stateful_loader_resumes_after_a_full_last_batch_of_the_epoch() -> None:
    n = 40  # 2 ranks x batch 4: every batch full
    make = stateful_loader(lambda: list(range(n)), **SHUFFLED)
    check_resume(make, Layout(2, 0, 4), Layout(3, 0, 5), num_samples=n, samples=range(n))


class _SwapsAfterALoad(Rig):
    """A loader whose first batch after a load has its first sample replaced by its
    second: every count right (batches, samples, ``len()``, padding), one sample lost
    and one repeated."""

    def __init__(self, inner: Rig) -> None:
        super().__init__()
        self.inner, self.loaded = inner, False
        self.plan_batch, self.in_order = inner.plan_batch, inner.in_order

    def _batches(self) -> Iterator[Any]:
        for ids in self.inner:
            if self.loaded and len(ids) > 1:
                ids, self.loaded = [ids[1], *ids[1:]], False
            yield ids

    def state(self) -> dict[str, Any]:
        return self.inner.state()

    def load(self, state: dict[str, Any]) -> None:
        self.inner.load(state)
        self.loaded = True

    def length(self) -> int | None:
        return self.inner.length()

    def remaining(self) -> int | None:
        return self.inner.remaining()

    def padding(self) -> int | None:
        return self.inner.padding()


def test_check_resume_names_the_sample_a_wrong_resume_lost_and_the_one_it_repeated() -> None:
    """The harness holds a resume to the resume checker's rules: resumed onto one rank (no
    padding), the epoch's samples each once; then each plan position holds the order's
    sample."""
    make = evenly_loader(numbers, **SHUFFLED)

    def swapping(rank: int, layout: Layout) -> Rig:
        return _SwapsAfterALoad(make(rank, layout))

    where = r"stop 0 \(epoch 0, 0 batch\(es\) received\) under 2 rank\(s\) .* -> 1 rank\(s\) .*"
    with pytest.raises(
        AssertionError,
        match=rf"^{where}: 1 missing \(e\.g\. \d+\); {where}: 1 repeated \(e\.g\. \d+\)$",
    ):
        check_resume(swapping, Layout(2, 0, 4), Layout(1, 0, 5), num_samples=N, every_batch=False)


# ---- steps: evenly.DataLoader(infinite=True) ------------------------------------------
# Each iter() of an infinite loader plans two chunks of 8192 stream positions ahead (some
# 440 epochs of 37 samples, ~0.3 s): few resumed ranks keep the every-step row short.
@pytest.mark.parametrize(
    ("before", "after", "every_batch", "worker_type"),
    [
        (Layout(2, 0, 4), Layout(1, 0, 6), True, "auto"),
        (Layout(2, 2, 4), Layout(3, 1, 4), False, "auto"),
        (Layout(2, 2, 4), Layout(1, 3, 6), False, "thread"),
    ],
    ids=["no-workers", "workers", "threads"],
)
def test_an_infinite_loader_resumes_by_step_across_epoch_boundaries(
    before: Layout, after: Layout, every_batch: bool, worker_type: str
) -> None:
    make = evenly_loader(numbers, infinite=True, worker_type=worker_type, **SHUFFLED)
    report = check_resume(
        make, before, after, num_samples=N, every_batch=every_batch, samples=range(N)
    )
    steps = -(-2 * N // before.step)
    assert report.stops == (list(range(steps)) if every_batch else [0, steps // 2, steps - 1])


# ---- a Mix inside evenly.Dataset ----------------------------------------------------------
# a mid-epoch Mix resume is exact at global step boundaries, and refuses a smaller step
# unless the Mix was built with min_step
MIX: dict[str, tuple[Make, Layout, Layout, bool]] = {
    "same-step": (
        evenly_loader(mixture, shuffle=True, seed=7),
        Layout(2, 0, 4),
        Layout(1, 0, 8),
        True,
    ),
    "bigger-step": (
        evenly_loader(mixture, shuffle=True, seed=7),
        Layout(2, 0, 4),
        Layout(4, 0, 4),
        True,
    ),
    "smaller-step-with-min-step": (
        evenly_loader(lambda: mixture(min_step=4), shuffle=True, seed=7),
        Layout(2, 0, 4),
        Layout(1, 0, 4),
        True,
    ),
    "workers": (
        evenly_loader(mixture, shuffle=True, seed=7),
        Layout(2, 2, 4),
        Layout(1, 1, 8),
        False,
    ),
}


@pytest.mark.parametrize("row", list(MIX))
def test_a_mix_resumes_exactly_from_every_step_boundary(row: str) -> None:
    make, before, after, every_batch = MIX[row]
    run(make, before, after, every_batch, topology_free=False)


def test_evenly_testing_lists_exactly_the_harness_names() -> None:
    """``evenly.testing`` names the harness's exports by hand (to load it lazily, without
    torch): the list and the harness's ``__all__`` are the same names."""
    import evenly.audit._harness as harness
    import evenly.testing as testing

    assert set(testing._HARNESS) == set(harness.__all__)
    assert all(getattr(testing, name) is getattr(harness, name) for name in harness.__all__)
