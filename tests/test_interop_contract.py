"""evenly under Accelerate's wrappers, in this process (no ranks): the contract of
``evenly.interop.accelerate`` with each configuration it recognises, and the clear error
each one it cannot make right raises before the first batch.

Two ranks are simulated the way Accelerate itself allows: ``prepare_data_loader`` with an
explicit ``num_processes``/``process_index`` (the shard wrapper), and datasets with an
explicit ``rank``/``world_size``.  The dispatcher runs with one process (rank 0 reads for
all), over a dataset told it is rank 0 of 2: reading everything shows the mode was seen.
The real 2-rank gloo runs are in ``tests/test_interop_accelerate.py``.
"""

from __future__ import annotations

import importlib.util
import math
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import ChainDataset, DataLoader, IterableDataset

import evenly
from tests.accelerate_state import fresh_accelerate  # noqa: F401  (autouse fixture)

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("accelerate") is None, reason="needs accelerate (test extra)"
    ),
    pytest.mark.filterwarnings("ignore::evenly.EvenlyWarning"),
]

N, B, WORLD = 101, 5, 2


class Tokenize(IterableDataset[Any]):
    """A user's wrapper: holds the evenly dataset in an attribute of its own naming and
    forwards ``__len__`` and ``set_epoch``."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.vocab = {"unused": 1}  # not a dataset: not searched

    def __len__(self) -> int:
        return len(self.inner)

    def set_epoch(self, epoch: int) -> None:
        self.inner.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        yield from self.inner


class NoEpoch(IterableDataset[Any]):
    """A wrapper that forwards ``__len__`` but not ``set_epoch``."""

    def __init__(self, inner: Any) -> None:
        self.source = inner

    def __len__(self) -> int:
        return len(self.source)

    def __iter__(self) -> Iterator[Any]:
        yield from self.source


class Hidden(IterableDataset[Any]):
    """A wrapper holding the evenly dataset where evenly does not look (a dict)."""

    def __init__(self, inner: Any) -> None:
        self.parts = {"train": inner}

    def __len__(self) -> int:
        return len(self.parts["train"])

    def set_epoch(self, epoch: int) -> None:
        self.parts["train"].set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        yield from self.parts["train"]


class Plain(IterableDataset[int]):
    def __iter__(self) -> Iterator[int]:
        yield from range(1000, 1010)


def _dataset(rank: int = 0, n: int = N) -> evenly.Dataset[Any]:
    return evenly.Dataset(list(range(n)), shuffle=True, seed=3, rank=rank, world_size=WORLD)


def _prepare(dataset: Any, *, workers: int = 0, **kw: Any) -> Any:
    from accelerate.data_loader import prepare_data_loader

    loader = DataLoader(
        dataset,
        batch_size=kw.pop("batch_size", B),
        num_workers=workers,
        persistent_workers=kw.pop("persistent", False),
        multiprocessing_context=kw.pop("context", None),
    )
    return prepare_data_loader(loader, device=torch.device("cpu"), **kw)


def _shard_loader(rank: int, dataset: Any, **kw: Any) -> Any:
    return _prepare(dataset, dispatch_batches=False, num_processes=WORLD, process_index=rank, **kw)


def _refused(loader: Any, match: str) -> None:
    """The first batch raises ``match``; the workers are shut down at once (a failed
    iterator left to the garbage collector makes a later test wait for them)."""
    try:
        with pytest.raises(RuntimeError, match=match):
            next(iter(loader))
    finally:
        it = vars(loader)["base_dataloader"].__dict__.get("_iterator")
        if it is not None and hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()


def _epoch(loader: Any) -> list[list[int]]:
    return [[int(i) for i in batch.tolist()] for batch in loader]


def _assert_once(ids: list[int], n: int = N) -> None:
    counts = Counter(ids)
    assert set(counts) == set(range(n)), f"{n - len(counts)} missing"
    assert sum(counts.values()) - n <= WORLD - 1


# ---- the dispatcher (the default) ---------------------------------------------------
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("wrap", [False, True], ids=["bare", "user-wrapper"])
def test_under_the_dispatcher_rank_0_reads_the_whole_epoch(workers: int, wrap: bool) -> None:
    ds = _dataset(rank=0)
    share = len(ds)
    loader = _prepare(Tokenize(Tokenize(ds)) if wrap else ds, put_on_device=True, workers=workers)
    for _ in range(2):
        batches, during = [], []
        for batch in loader:
            batches.append([int(i) for i in batch.tolist()])
            during.append(len(loader))  # while the dispatcher drives the pass: exact
        assert len(batches) == math.ceil(N / B)
        assert set(during) == {math.ceil(N / B)}
        _assert_once([i for b in batches for i in b])
    # after the prepared epochs the dataset is its own again (boundaries hole 2)
    assert len(ds) == share == math.ceil(N / WORLD)
    ids = [int(i) for b in evenly.DataLoader(ds, batch_size=B) for i in b.tolist()]
    assert len(ids) == share


def test_under_the_dispatcher_a_wrapper_without_set_epoch_still_reads_the_whole_epoch() -> None:
    """Forked workers read GradientState as it was when they started."""
    loader = _prepare(NoEpoch(_dataset()), put_on_device=True, workers=2)
    _assert_once([i for b in _epoch(loader) for i in b])


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
def test_under_the_dispatcher_spawned_workers_get_the_mode_with_the_dataset() -> None:
    loader = _prepare(Tokenize(_dataset()), put_on_device=True, workers=2, context="spawn")
    _assert_once([i for b in _epoch(loader) for i in b])


# ---- the shard wrapper (dispatch_batches=False) ---------------------------------------
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("wrap", [False, True], ids=["bare", "user-wrapper"])
def test_under_the_shard_wrapper_each_rank_reads_its_own_share(workers: int, wrap: bool) -> None:
    n = N
    datasets = [_dataset(rank=r) for r in range(WORLD)]
    loaders = [
        _shard_loader(r, Tokenize(ds) if wrap else ds, workers=workers)
        for r, ds in enumerate(datasets)
    ]
    per_rank = math.ceil(math.ceil(n / WORLD) / B)
    for _ in range(2):
        epoch = [_epoch(loader) for loader in loaders]
        assert [len(batches) for batches in epoch] == [per_rank] * WORLD
        _assert_once([i for batches in epoch for b in batches for i in b])
        assert [len(loader) for loader in loaders] == [per_rank] * WORLD  # passed through
    assert [len(ds) for ds in datasets] == [math.ceil(n / WORLD)] * WORLD


@pytest.mark.parametrize("workers", [0, 2])
def test_a_shard_wrapper_that_never_reaches_set_epoch_is_refused(workers: int) -> None:
    loader = _shard_loader(0, NoEpoch(_dataset()), workers=workers, persistent=workers > 0)
    _refused(loader, r"split each rank's share again.*set_epoch")


@pytest.mark.parametrize("dispatch", [True, False], ids=["dispatcher", "shard"])
def test_a_dataset_evenly_cannot_find_under_the_wrapper_is_refused(dispatch: bool) -> None:
    ds = _dataset()
    if dispatch:
        loader = _prepare(Hidden(ds), put_on_device=True, workers=2, persistent=True)
    else:
        loader = _shard_loader(0, Hidden(ds), workers=2, persistent=True)
    _refused(loader, r"cannot find it through.*attribute")


class Mixed(Tokenize):
    """A wrapper chaining the evenly dataset with a stream of its own."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.both = ChainDataset([inner, Plain()])

    def __iter__(self) -> Iterator[Any]:
        yield from self.both


def test_a_shard_over_other_iterable_datasets_too_is_refused() -> None:
    _refused(_shard_loader(0, Mixed(_dataset())), r"other iterable datasets \(Plain\)")


def test_split_batches_without_dispatch_reads_each_share_in_per_rank_batches() -> None:
    loaders = [
        _shard_loader(r, _dataset(rank=r), batch_size=2 * B, split_batches=True)
        for r in range(WORLD)
    ]
    epoch = [_epoch(loader) for loader in loaders]
    assert {len(b) for batches in epoch for b in batches[:-1]} == {B}
    _assert_once([i for batches in epoch for b in batches for i in b])
    assert len(loaders[0]) == len(epoch[0])  # passed through: the count is exact


# ---- use_stateful_dataloader=True (boundaries hole 4) -------------------------------
@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")
@pytest.mark.parametrize("dispatch", [None, False], ids=["dispatcher", "shard"])
def test_workers_started_inside_prepare_are_refused(dispatch: bool | None) -> None:
    pytest.importorskip("torchdata.stateful_dataloader")
    kw: dict[str, Any] = {"put_on_device": True, "use_stateful_dataloader": True}
    if dispatch is False:
        kw.update(dispatch_batches=False, num_processes=WORLD, process_index=0)
    _refused(_prepare(_dataset(), workers=2, **kw), r"inside prepare\(\).*use_stateful")


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")
def test_a_stateful_dispatcher_without_workers_reads_the_whole_epoch() -> None:
    pytest.importorskip("torchdata.stateful_dataloader")
    loader = _prepare(_dataset(), put_on_device=True, use_stateful_dataloader=True)
    batches = _epoch(loader)
    assert len(batches) == math.ceil(N / B)
    _assert_once([i for b in batches for i in b])


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")
def test_a_stateful_shard_wrapper_without_workers_reads_each_share() -> None:
    pytest.importorskip("torchdata.stateful_dataloader")
    loaders = [
        _shard_loader(r, _dataset(rank=r), use_stateful_dataloader=True) for r in range(WORLD)
    ]
    per_rank = math.ceil(math.ceil(N / WORLD) / B)
    epoch = [_epoch(loader) for loader in loaders]
    assert [len(batches) for batches in epoch] == [per_rank] * WORLD
    _assert_once([i for batches in epoch for b in batches for i in b])
    assert [len(loader) for loader in loaders] == [per_rank] * WORLD  # passed through


# ---- what stays the dataset's own -------------------------------------------------
def test_nothing_here_initialises_accelerate() -> None:
    import accelerate.data_loader  # noqa: F401  (imported, never initialised)
    from accelerate.state import GradientState

    ds = _dataset()
    ds.set_epoch(1)
    assert len(ds) == math.ceil(N / WORLD)
    assert len(list(DataLoader(ds, batch_size=B, num_workers=2))) == math.ceil(len(ds) / B)
    assert GradientState._shared_state == {}


def test_another_loader_iterated_during_a_prepared_epoch_is_not_affected() -> None:
    """An evaluation loader over another dataset, inside a training epoch."""
    train = _prepare(_dataset(), put_on_device=True)
    held_out = _dataset(rank=1)
    it = iter(train)
    next(it)
    assert len(held_out) == math.ceil(N / WORLD)
    ids = [int(i) for b in DataLoader(held_out, batch_size=B, num_workers=2) for i in b.tolist()]
    assert len(ids) == len(held_out)  # rank 1's share, not the whole epoch
    list(it)


def test_len_asked_directly_during_a_prepared_epoch_counts_the_pass_in_progress() -> None:
    ds = _dataset()
    loader = _prepare(ds, put_on_device=True)
    it = iter(loader)
    next(it)
    assert len(ds) == N  # rank 0 reads for all while the dispatcher drives it
    list(it)
    assert len(ds) == math.ceil(N / WORLD)


# ---- len() asked before the pass: evenly looks at no caller ------------------------
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("dispatch", [True, False], ids=["dispatcher", "shard"])
@pytest.mark.parametrize("wrap", [False, True], ids=["bare", "user-wrapper"])
def test_a_len_asked_before_the_pass_that_the_pass_does_not_match_is_refused(
    workers: int, dispatch: bool, wrap: bool
) -> None:
    """len() of a prepared loader asked before its pass (the HF Trainer counts its steps
    so) gets the dataset's own share: where the wrapper's pass yields another count, the
    first batch raises, naming the Trainer adapter and the evenly.DataLoader."""
    ds = _dataset(rank=0)
    inner = Tokenize(ds) if wrap else ds
    if dispatch:
        loader = _prepare(inner, put_on_device=True, workers=workers, persistent=workers > 0)
        asked = math.ceil(math.ceil(N / WORLD) / B)  # rank 0's own share, in batches
    else:
        loader = _shard_loader(0, inner, workers=workers, persistent=workers > 0)
        asked = math.ceil(math.ceil(N / WORLD) / (B * WORLD))  # split once more
    assert len(loader) == asked
    _refused(loader, r"asked before its pass.*TrainerMixin.*evenly\.DataLoader")


@pytest.mark.parametrize("dispatch", [True, False], ids=["dispatcher", "shard"])
def test_a_len_asked_before_the_pass_is_exact_with_one_process_and_one_rank(
    dispatch: bool,
) -> None:
    """One process, one rank (the HF Trainer on one device): the dataset's own share is
    the whole epoch, so the count asked before the pass is the pass's."""
    ds = evenly.Dataset(list(range(N)), shuffle=True, seed=3, rank=0, world_size=1)
    loader = _prepare(ds, put_on_device=True, dispatch_batches=None if dispatch else False)
    assert len(loader) == math.ceil(N / B)
    for _ in range(2):
        batches = _epoch(loader)
        assert len(batches) == len(loader)
        _assert_once([i for b in batches for i in b])


@pytest.mark.parametrize("pad", ["repeat", "mask", "none"])
def test_gather_for_metrics_over_a_padded_evenly_loader_is_warned_once(pad: str) -> None:
    """Accelerate keeps an evenly.DataLoader as it is, so gather_for_metrics would keep
    its padding repeats: under Accelerate the default pad says so once per loader, and
    pad='mask' or pad='none' (the ways to evaluate exactly) say nothing."""
    import warnings

    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    kw: dict[str, Any] = {"transform": lambda x: x} if pad == "mask" else {}
    ds = evenly.Dataset(list(range(N)), rank=0, world_size=WORLD, pad=pad, **kw)
    loader = accelerator.prepare(evenly.DataLoader(ds, batch_size=B))
    assert isinstance(loader, evenly.DataLoader)  # kept as it is
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            list(loader)
    said = [str(w.message) for w in caught if "gather_for_metrics() keeps" in str(w.message)]
    if pad == "repeat":
        assert len(said) == 1 and "pad='mask'" in said[0] and "1 repeated" in said[0]
    else:
        assert said == []


def test_an_evenly_pass_is_the_active_dataloader_accelerate_reads_the_epoch_end_from() -> None:
    """Under Accelerate, a pass of an evenly.DataLoader is GradientState's active
    dataloader: end_of_dataloader as its last batch is handed out, the gathered last
    batch's real rows as remainder (its processes being the plan's ranks), and gone once
    the pass ends or is dropped after a break."""
    import warnings

    from accelerate import Accelerator
    from accelerate.state import GradientState

    Accelerator(cpu=True)  # one process
    state = GradientState()
    loader = evenly.DataLoader(evenly.Dataset(list(range(N)), rank=0, world_size=1), batch_size=B)
    seen = [(state.active_dataloader is not None, state.end_of_dataloader) for _ in loader]
    assert seen == [(True, False)] * (len(seen) - 1) + [(True, True)]
    assert state.active_dataloader is None
    for _ in loader:
        assert state.remainder == 0  # one rank: nothing padded
        break
    assert state.active_dataloader is None
    two = evenly.Dataset(list(range(N)), rank=0, world_size=WORLD)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", evenly.EvenlyWarning)
        for _ in evenly.DataLoader(two, batch_size=B):
            assert state.remainder == -1  # 2 ranks, 1 process: Accelerate keeps every row


def times_ten(x: int) -> int:
    return x * 10


def _skip_loader(workers: int, context: str | None = None) -> evenly.DataLoader:
    ds = evenly.Dataset(list(range(N)), shuffle=True, seed=2, transform=times_ten)
    return evenly.DataLoader(ds, batch_size=B, num_workers=workers, multiprocessing_context=context)


def _epochs(loader: Any, n: int = 2) -> list[list[list[int]]]:
    return [[b.tolist() for b in loader] for _ in range(n)]


@pytest.mark.parametrize(("workers", "context"), [(0, None), (2, "fork"), (3, "spawn")])
def test_skip_first_batches_over_an_evenly_loader_gives_the_rest_of_its_epoch(
    workers: int, context: str | None
) -> None:
    """accelerate's skip_first_batches() builds a SkipDataLoader from an
    evenly.DataLoader's dataset: the dataset serves its owner's pass from the k-th batch
    (the k batches the SkipDataLoader drops are fillers, not reads), and the owner goes
    on with the next epoch; with k not a multiple of the workers too."""
    from accelerate import Accelerator

    reference = _epochs(_skip_loader(0))
    accelerator = Accelerator(cpu=True)
    loader = accelerator.prepare(_skip_loader(workers, context))
    for k in (2, 0):
        skipped = accelerator.skip_first_batches(loader, k)
        assert [b.tolist() for b in skipped] == reference[0][k:]
        assert [b.tolist() for b in loader] == reference[1]  # then the next epoch
        loader.set_epoch(0)


@pytest.mark.parametrize("workers", [0, 2])
def test_skip_first_batches_after_load_state_is_exact_or_refused(workers: int) -> None:
    """After a state loaded into the evenly.DataLoader (what accelerator.load_state
    does), skipping the batches the state says were received gives the rest once; any
    other count is a clear error before the first batch."""
    from accelerate import Accelerator

    reference = _epochs(_skip_loader(0))
    old = _skip_loader(0)
    it = iter(old)
    for _ in range(7):
        next(it)
    state = old.state_dict()
    accelerator = Accelerator(cpu=True)
    loader = accelerator.prepare(_skip_loader(workers))
    loader.load_state_dict(state)
    with pytest.raises(RuntimeError, match=r"says 7 batch\(es\).*skip exactly 7"):
        next(iter(accelerator.skip_first_batches(loader, 2)))
    assert [b.tolist() for b in accelerator.skip_first_batches(loader, 7)] == reference[0][7:]
    assert [b.tolist() for b in loader] == reference[1]
