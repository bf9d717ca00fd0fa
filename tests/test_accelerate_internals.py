"""The HF Accelerate internals that ``evenly.interop.accelerate`` relies on, checked against
the installed version (``constraints.txt`` pins the one CI runs), in this process: no ranks.

A rename or a change of meaning of any of these would make evenly's recognition of
Accelerate's wrappers silently fail (and data be sharded twice): these tests fail instead.

- ``GradientState._shared_state`` is empty until Accelerate is initialised (evenly never
  initialises it); ``GradientState().active_dataloader`` is the adapter whose
  ``__iter__`` runs, from before it calls ``set_epoch`` (and before its base loader
  starts workers) to the end of its epoch, then ``None``;
- ``prepare_data_loader`` over an iterable dataset: a ``DataLoaderDispatcher`` by default,
  a ``DataLoaderShard`` over an ``IterableDatasetShard`` with ``dispatch_batches=False``;
  the adapter keeps its torch loader in ``vars(adapter)["base_dataloader"]`` and claims
  that loader's class;
- ``IterableDatasetShard``'s fields, its ``__len__`` arithmetic, and that with
  ``num_processes=1, process_index=0, batch_size=1, drop_last=False`` it yields its
  dataset as it is (the one change evenly makes);
- ``len(adapter)`` asks ``len(base_dataloader)``, whose answer torch records on the base
  loader (``torch_compat.len_answered``: how evenly sees, at the pass start, that a count
  was asked before the wrapper drove the dataset; it looks at no caller);
- ``use_stateful_dataloader=True`` starts the base loader's iterator inside ``prepare()``,
  marked ``_initial_iter_for_state_dict`` (torchdata) until the first ``iter()``;
- ``prepare()`` keeps a loader that says ``_is_accelerate_prepared``; ``save_state`` /
  ``load_state`` save and load ``loader.state_dict()`` when it says
  ``use_stateful_dataloader``;
- ``GradientState()._add_dataloader(x)`` / ``_remove_dataloader(x)`` make any object the
  active dataloader (held weakly) and remove it; ``GradientState().end_of_dataloader``
  and ``.remainder`` are the active one's attributes; ``gather_for_metrics`` keeps the
  first ``remainder`` rows of the gathered batch when ``end_of_dataloader`` and
  ``remainder > 0``, every row when ``remainder`` is 0 or -1 (``interop/gather.py``);
  ``PartialState._shared_state`` is set and ``PartialState().num_processes`` counts the
  processes once an ``Accelerator`` exists.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from tests.accelerate_state import fresh_accelerate  # noqa: F401  (autouse fixture)

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("accelerate") is None, reason="needs accelerate (test extra)"
)


class Spy(IterableDataset[int]):
    """0..n-1 (split between workers), recording what Accelerate asks of it and what
    GradientState says at that moment (in the main process)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.calls: list[tuple[str, Any]] = []
        self.len_asked = 0

    def set_epoch(self, epoch: int) -> None:
        from accelerate.state import GradientState

        self.calls.append(("set_epoch", GradientState().active_dataloader))

    def __len__(self) -> int:
        self.len_asked += 1
        return self.n

    def __iter__(self) -> Iterator[int]:
        info = torch.utils.data.get_worker_info()
        if info is None:
            from accelerate.state import GradientState

            self.calls.append(("iter", GradientState().active_dataloader))
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        return iter(range(start, self.n, step))


def _prepare(dataset: Any, **kw: Any) -> Any:
    from accelerate.data_loader import prepare_data_loader

    names = ("num_workers", "persistent_workers", "drop_last")
    loader_kw = {k: kw.pop(k) for k in names if k in kw}
    loader = DataLoader(dataset, batch_size=kw.pop("batch_size", 4), **loader_kw)
    return prepare_data_loader(loader, device=torch.device("cpu"), **kw)


def _ids(loader: Any) -> list[int]:
    return [int(i) for batch in loader for i in batch.tolist()]


def test_gradient_state_is_empty_until_accelerate_is_initialised() -> None:
    from accelerate.state import GradientState

    assert GradientState._shared_state == {}
    assert not GradientState._shared_state  # what evenly checks before looking further
    GradientState()
    assert GradientState._shared_state != {}
    assert GradientState().active_dataloader is None  # initialised, nothing iterated


@pytest.mark.parametrize("workers", [0, 2])
def test_the_dispatcher_is_the_active_dataloader_while_it_drives_the_dataset(workers: int) -> None:
    from accelerate.data_loader import DataLoaderDispatcher
    from accelerate.state import GradientState

    spy = Spy(24)
    loader = _prepare(spy, put_on_device=True, num_workers=workers, persistent_workers=workers > 0)
    assert type(loader) is DataLoaderDispatcher
    base = vars(loader)["base_dataloader"]
    assert type(base) is DataLoader and base.dataset is spy and base.batch_size == 4
    assert isinstance(loader, DataLoader)  # DataLoaderAdapter.__class__ claims the base's
    assert loader.dataset is spy  # ... and its attributes (through __getattr__)
    seen = 0
    for _ in range(2):  # the second epoch: persistent workers are reused
        before = base.__dict__.get("_iterator")
        assert sorted(_ids(loader)) == list(range(24))
        # set_epoch reached the dataset while the dispatcher was the active dataloader
        epoch_calls = spy.calls[seen:]
        seen = len(spy.calls)
        assert epoch_calls[0] == ("set_epoch", loader)
        if workers == 0:
            assert epoch_calls[1] == ("iter", loader)
        elif before is None:
            assert base._iterator is not None  # started after set_epoch, inside __iter__
        assert GradientState().active_dataloader is None  # the epoch's end() removed it
    if workers:
        base._iterator._shutdown_workers()


def test_gradient_state_holds_the_adapter_weakly_and_the_last_one_begun_is_active() -> None:
    from accelerate.state import GradientState

    outer = _prepare(Spy(8), put_on_device=True)
    inner = _prepare(Spy(8), put_on_device=True)
    it = iter(outer)
    next(it)
    assert GradientState().active_dataloader is outer
    assert [int(i) for b in inner for i in b.tolist()] == list(range(8))
    assert GradientState().active_dataloader is outer  # inner's end() removed only inner
    assert GradientState().dataloader_references[-1] is outer
    list(it)
    assert GradientState().active_dataloader is None


@pytest.mark.parametrize("workers", [0, 2])
def test_without_dispatch_a_shard_adapter_wraps_the_dataset_in_an_iterable_dataset_shard(
    workers: int,
) -> None:
    from accelerate.data_loader import DataLoaderShard, IterableDatasetShard
    from accelerate.state import GradientState

    spy = Spy(40)
    loader = _prepare(
        spy, dispatch_batches=False, num_processes=2, process_index=1, num_workers=workers
    )
    assert type(loader) is DataLoaderShard
    base = vars(loader)["base_dataloader"]
    shard = base.dataset
    assert type(shard) is IterableDatasetShard and shard.dataset is spy
    assert (shard.batch_size, shard.drop_last, shard.num_processes, shard.process_index) == (
        4,
        False,
        2,
        1,
    )
    assert shard.split_batches is False
    assert base.batch_size == 4  # the per-rank batch
    ids = _ids(loader)
    if workers == 0:  # (with workers, each worker's copy pads its own stream)
        assert ids == [i for b in range(0, 40, 8) for i in range(b + 4, b + 8)]
    assert GradientState().active_dataloader is None
    # IterableDatasetShard.set_epoch passed the adapter's set_epoch down, while active
    assert spy.calls[0] == ("set_epoch", loader)


def test_split_batches_gives_the_base_loader_the_per_rank_batch() -> None:
    from accelerate.data_loader import IterableDatasetShard

    loader = _prepare(
        Spy(40),
        batch_size=8,
        dispatch_batches=False,
        split_batches=True,
        num_processes=2,
        process_index=0,
    )
    base = vars(loader)["base_dataloader"]
    assert isinstance(base.dataset, IterableDatasetShard)
    assert (base.batch_size, base.dataset.batch_size, base.dataset.split_batches) == (4, 8, True)


def test_one_process_without_dispatch_does_not_wrap_the_dataset() -> None:
    from accelerate.data_loader import DataLoaderShard

    spy = Spy(8)
    loader = _prepare(spy, dispatch_batches=False)
    assert type(loader) is DataLoaderShard and vars(loader)["base_dataloader"].dataset is spy


@pytest.mark.parametrize("drop_last", [False, True])
def test_iterable_dataset_shard_arithmetic_and_pass_through(drop_last: bool) -> None:
    from accelerate.data_loader import IterableDatasetShard

    n, batch, procs = 103, 5, 2
    shards = [
        IterableDatasetShard(
            Spy(n), batch_size=batch, drop_last=drop_last, num_processes=procs, process_index=p
        )
        for p in range(procs)
    ]
    # __len__: from its dataset's (what a count asked before evenly's pass is made of)
    rounding = math.floor if drop_last else math.ceil
    for shard in shards:
        asked = shard.dataset.len_asked
        assert len(shard) == rounding(n / (batch * procs)) * batch
        assert shard.dataset.len_asked == asked + 1
    # the change evenly makes: everything passes through, in order
    shard = shards[1]
    shard.num_processes, shard.process_index, shard.batch_size = 1, 0, 1
    shard.drop_last = False
    assert list(shard) == list(range(n))
    assert len(shard) == n


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")
@pytest.mark.parametrize("stateful", [False, True])
def test_len_of_either_adapter_is_recorded_on_its_base_loader(stateful: bool) -> None:
    """What ``evenly.interop.accelerate`` compares at the pass start: the last answer of
    ``len(base_dataloader)`` (``torch_compat.len_answered``), which ``len(adapter)`` asks."""
    from accelerate.data_loader import IterableDatasetShard

    from evenly.runtime import torch_compat

    if stateful:
        pytest.importorskip("torchdata.stateful_dataloader")
    kw: dict[str, Any] = {"use_stateful_dataloader": True} if stateful else {}
    spy = Spy(40)
    dispatcher = _prepare(spy, put_on_device=True, **kw)
    base = vars(dispatcher)["base_dataloader"]
    assert torch_compat.len_answered(base) is None  # never asked
    assert len(dispatcher) == 10  # ceil(ceil(40 / 4) / 1 process)
    assert torch_compat.len_answered(base) == 40 and spy.len_asked == 1

    spy = Spy(40)
    shard_loader = _prepare(spy, dispatch_batches=False, num_processes=2, process_index=0, **kw)
    base = vars(shard_loader)["base_dataloader"]
    assert type(base.dataset) is IterableDatasetShard and base.dataset.dataset is spy
    assert len(shard_loader) == 5
    assert torch_compat.len_answered(base) == len(base.dataset) == 20  # ceil(40 / 8) * 4


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")
def test_a_stateful_base_loader_starts_its_workers_inside_prepare() -> None:
    pytest.importorskip("torchdata.stateful_dataloader")
    from torchdata.stateful_dataloader import StatefulDataLoader

    loader = _prepare(Spy(24), put_on_device=True, use_stateful_dataloader=True, num_workers=2)
    base = vars(loader)["base_dataloader"]
    assert type(base) is StatefulDataLoader and base.num_workers == 2
    assert base._iterator is not None and base._initial_iter_for_state_dict is True
    early = base._iterator
    assert [w.is_alive() for w in early._workers] == [True, True]  # already started
    assert sorted(_ids(loader)) == list(range(24))
    assert base._initial_iter_for_state_dict is False  # the first iter() used that iterator


def test_a_plain_torch_loader_has_no_early_iterator_flag() -> None:
    base = vars(_prepare(Spy(8), put_on_device=True))["base_dataloader"]
    assert getattr(base, "_initial_iter_for_state_dict", False) is False


def test_prepare_keeps_an_evenly_loader_and_save_state_saves_its_state(tmp_path: Path) -> None:
    from accelerate import Accelerator

    import evenly

    loader = evenly.DataLoader(evenly.Dataset(list(range(20))), batch_size=4)
    accelerator = Accelerator(cpu=True)
    assert accelerator.prepare(loader) is loader  # _is_accelerate_prepared
    it = iter(loader)
    next(it)
    next(it)
    expected = loader.state_dict()
    accelerator.save_state(str(tmp_path))
    saved = torch.load(tmp_path / "dl_state_dict.bin", weights_only=False)
    assert saved == expected
    fresh = evenly.DataLoader(evenly.Dataset(list(range(20))), batch_size=4)
    other = Accelerator(cpu=True)
    other.prepare(fresh)
    other.load_state(str(tmp_path))
    assert [b.tolist() for b in fresh] == [b.tolist() for b in it]


def test_skip_first_batches_rebuilds_a_dispatcher_over_the_same_dataset() -> None:
    from accelerate import skip_first_batches
    from accelerate.data_loader import DataLoaderDispatcher

    spy = Spy(40)
    skipped = skip_first_batches(_prepare(spy, put_on_device=True), 3)
    assert type(skipped) is DataLoaderDispatcher and skipped.skip_batches == 3
    assert vars(skipped)["base_dataloader"].dataset is spy
    assert _ids(skipped) == list(range(12, 40))


def test_skip_first_batches_of_a_loader_it_did_not_wrap_is_a_skip_loader_in_gradient_state() -> (
    None
):
    """For a loader Accelerate did not wrap, skip_first_batches() builds a SkipDataLoader
    over ``loader.dataset`` whose ``__iter__`` calls ``begin()``: GradientState names it
    while it runs (what ``evenly.interop.skip`` relies on)."""
    from accelerate import skip_first_batches
    from accelerate.data_loader import SkipDataLoader
    from accelerate.state import GradientState

    seen: list[Any] = []

    class Spy(torch.utils.data.IterableDataset[int]):
        def __iter__(self) -> Any:
            seen.append(GradientState().active_dataloader)
            yield from range(6)

    dataset = Spy()
    skipped = skip_first_batches(torch.utils.data.DataLoader(dataset, batch_size=2), 1)
    assert isinstance(skipped, SkipDataLoader) and skipped.dataset is dataset
    assert skipped.skip_batches == 1  # the count evenly's delegated pass leaves out
    assert [b.tolist() for b in skipped] == [[2, 3], [4, 5]]
    assert seen == [skipped]


class _End:
    """Stands for what evenly registers (``interop.gather.EpochEnd``)."""

    def __init__(self, remainder: int) -> None:
        self.end_of_dataloader = False
        self.remainder = remainder


def test_any_object_can_be_the_active_dataloader_that_gather_for_metrics_truncates_by() -> None:
    import gc
    import weakref

    from accelerate import Accelerator
    from accelerate.state import GradientState, PartialState

    accelerator = Accelerator(cpu=True)
    assert PartialState._shared_state and PartialState().num_processes == 1
    state = GradientState()
    rows = torch.arange(6)
    end = _End(remainder=4)
    state._add_dataloader(end)
    assert state.active_dataloader is end and state.in_dataloader
    assert state.end_of_dataloader is False and state.remainder == 4
    assert accelerator.gather_for_metrics(rows).tolist() == list(range(6))  # not the end yet
    end.end_of_dataloader = True
    assert state.end_of_dataloader is True
    assert accelerator.gather_for_metrics(rows).tolist() == [0, 1, 2, 3]
    pair = {"a": rows, "b": rows * 10}  # every tensor of a structure alike
    assert accelerator.gather_for_metrics(pair)["b"].tolist() == [0, 10, 20, 30]
    for kept in (0, -1):
        end.remainder = kept
        assert accelerator.gather_for_metrics(rows).tolist() == list(range(6))
    state._remove_dataloader(end)
    assert state.active_dataloader is None and state.end_of_dataloader is False
    state._add_dataloader(end)  # held weakly
    ref = weakref.ref(end)
    del end
    gc.collect()
    assert ref() is None and state.active_dataloader is None
