"""A zoo of loaders for the resume audit: one right, each of the others with one resume
defect users report.  Factories are module-level (the audit's spawned ranks import them).

``ZooLoader`` is a plain Python loader (a ``LoaderFactory`` makes it): under DDP each
rank takes every ``world_size``-th sample of the epoch's permutation, in batches; its
state is ``{"epoch", "pos", "finished"}`` (samples delivered in the epoch; a state saved
after the pass ended loads as the next epoch's start).  Each
``defect`` breaks exactly one thing:

- ``forgets_position``: the state says nothing was delivered (the epoch restarts).
- ``loses_buffered``: it reads 3 samples ahead into a shuffle buffer and saves the read
  position without the buffer (the buffered samples are lost).
- ``repeats_prefetched``: it saves the 2 prefetched batches to replay them, and the
  position before them (the prefetched batches come twice).
- ``skips_epoch``: a state saved after the pass ended advances the epoch, and loading it
  advances it again (the next epoch is skipped).
- ``stale_offset``: it saves the samples delivered since the last load (right after one
  resume, wrong after the second).
- ``rank_state``: right, but the state names the rank (it cannot move to another
  world size).
- ``unloadable``: its ``load_state_dict`` refuses every state (it cannot resume at all).
- ``len_left``: right, but after a load ``len()`` counts only the batches left (the
  standing rule: the batches received in the epoch + those left).
- ``splits_last_batch``: after a load, the last rank yields each epoch's last batch in
  two halves (and its ``len()`` counts them): the same samples in the same order, but
  one batch more than the other ranks, on which DDP hangs.

``Stream`` is an ``IterableDataset`` with ``state_dict``/``load_state_dict`` (the audit runs
it under torchdata's ``StatefulDataLoader``, workers included); at the end of a pass it
moves to the next epoch's start, so a state saved at the boundary resumes there.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch.distributed as dist
from torch.utils.data import IterableDataset, get_worker_info

import evenly
from evenly.audit import LoaderFactory

DEFECTS = (
    "forgets_position",
    "loses_buffered",
    "repeats_prefetched",
    "skips_epoch",
    "stale_offset",
    "len_left",
    "splits_last_batch",
)

#: Samples per epoch (every rank gets the same number: no padding to judge).
SIZE = 48
BUFFER = 3
PREFETCH = 2


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _order(epoch: int, size: int) -> list[int]:
    return [int(x) for x in np.random.default_rng((7, epoch)).permutation(size)]


class ZooLoader:
    """A loader with at most one resume defect (see the module docstring)."""

    def __init__(
        self, defect: str | None, size: int, batch_size: int, collate_fn: Callable[..., Any]
    ) -> None:
        self.defect = defect
        self.size = size
        self.batch_size = batch_size
        self.collate_fn = collate_fn
        self.rank, self.world_size = _rank_world()
        self.epoch = self.pos = self.loaded_at = 0
        self.finished = self.loaded = False
        self.replay: list[list[int]] = []

    def _mine(self) -> list[int]:
        return _order(self.epoch, self.size)[self.rank :: self.world_size]

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.pos, self.finished = epoch, 0, False

    def _splits(self) -> bool:
        return (
            self.defect == "splits_last_batch"
            and self.loaded
            and self.rank == self.world_size - 1
            and self.batch_size > 1
        )

    def __len__(self) -> int:
        if self.defect == "len_left":
            return -(-(len(self._mine()) - self.loaded_at) // self.batch_size)
        return -(-len(self._mine()) // self.batch_size) + int(self._splits())

    def __iter__(self) -> Iterator[Any]:
        mine = self._mine()
        while self.replay:
            yield self.collate_fn(self.replay.pop(0))
        while self.pos < len(mine):
            batch = mine[self.pos : self.pos + self.batch_size]
            if self._splits() and len(batch) == self.batch_size == len(mine) - self.pos:
                batch = batch[: len(batch) // 2]  # the rest comes as one more batch
            self.pos += len(batch)
            yield self.collate_fn(batch)
        self.finished = True

    def state_dict(self) -> dict[str, Any]:
        pos, epoch = self.pos, self.epoch
        state: dict[str, Any] = {"epoch": epoch, "pos": pos, "finished": self.finished}
        if self.defect == "forgets_position":
            state["pos"] = 0
        elif self.defect == "loses_buffered":
            state["pos"] = min(pos + BUFFER, len(self._mine()))
        elif self.defect == "repeats_prefetched":
            mine, b = self._mine(), self.batch_size
            state["replay"] = [mine[pos + i * b : pos + (i + 1) * b] for i in range(PREFETCH)]
            state["replay"] = [x for x in state["replay"] if x]
        elif self.defect == "skips_epoch" and self.finished:
            state = {"epoch": epoch + 1, "pos": 0, "finished": True}
        elif self.defect == "stale_offset":
            state["pos"] = max(0, pos - self.loaded_at)
        elif self.defect == "rank_state":
            state["rank"] = self.rank
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.defect == "unloadable":
            raise ValueError("this state was saved by another version")
        self.epoch, self.pos = int(state["epoch"]), int(state["pos"])
        self.finished = False
        if state["finished"]:  # saved at the epoch boundary: the next epoch starts
            self.epoch, self.pos = self.epoch + 1, 0
        self.replay = [list(b) for b in state.get("replay", [])]
        self.loaded_at = self.pos
        self.loaded = True


def _make(defect: str | None, size: int, **kwargs: Any) -> ZooLoader:
    kwargs.pop("num_workers")
    return ZooLoader(defect, size, kwargs.pop("batch_size"), kwargs.pop("collate_fn"))


def zoo(defect: str | None = None, size: int = SIZE) -> LoaderFactory:
    """The factory of one zoo loader (``defect=None``: the right one)."""
    return LoaderFactory(make=functools.partial(_make, defect, size))


class Stream(IterableDataset[int]):
    """Every rank's share of the epoch's permutation, dealt to workers, with the position
    of this worker in its state (right, under StatefulDataLoader)."""

    def __init__(self, size: int = SIZE) -> None:
        self.size = size
        self.rank, self.world_size = _rank_world()
        self.epoch = self.pos = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.pos = epoch, 0

    def __iter__(self) -> Iterator[int]:
        info = get_worker_info()
        wid, nw = (0, 1) if info is None else (info.id, info.num_workers)
        mine = _order(self.epoch, self.size)[self.rank :: self.world_size][wid::nw]
        while self.pos < len(mine):
            self.pos += 1
            yield mine[self.pos - 1]
        # the pass ended: a state saved now resumes at the next epoch's start
        self.epoch, self.pos = self.epoch + 1, 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.pos = int(state["epoch"]), int(state["pos"])


def forgets_position() -> LoaderFactory:
    """``zoo("forgets_position")`` under a name the CLI can import."""
    return zoo("forgets_position")


def stream(size: int = SIZE) -> Stream:
    return Stream(size)


def evenly_dataset(size: int = 60) -> evenly.Dataset[int]:
    return evenly.Dataset(list(range(size)), shuffle=True, seed=0)
