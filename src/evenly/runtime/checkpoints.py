"""Checkpoints of an ``evenly.Dataset``: its fingerprint, and states of its own passes
(under any loader) or at a given position (for ``evenly.DataLoader``).  See
``evenly.core.state`` for the format."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import get_worker_info

from evenly.core.plan import EpochPlan
from evenly.core.spec import PassSpec
from evenly.core.state import check_state, make_state
from evenly.errors import StateError, check_int
from evenly.runtime.channel import PassCounter

__all__ = ["Checkpoints"]


class Checkpoints:
    """The checkpoint methods of ``evenly.Dataset`` (a mixin: it uses the dataset's
    source, settings, pass counter and progress)."""

    _source: Any
    seed: int
    shuffle_mode: str
    drop_last: bool
    block_shards: int
    _counter: PassCounter
    _skipped: torch.Tensor
    _progress: list[int]
    _local_skip: int
    _own_spec: Callable[..., PassSpec]
    plan_for: Callable[[PassSpec], EpochPlan]
    plan: Callable[[], EpochPlan]

    @property
    def _yielded(self) -> int:
        """Samples this process's iterator has handed out in the current pass (counted a
        batch at a time, as the batch starts: exact at batch boundaries)."""
        return self._progress[0]

    # ---- checkpoints -----------------------------------------------------------
    def fingerprint(self, drop_last: bool | None = None) -> dict[str, Any]:
        """What a checkpoint state must agree on: N, seed, shuffle, drop_last (the
        loader's, when a loader owns the passes), source."""
        fp: dict[str, Any] = {
            "num_samples": len(self._source),
            "seed": self.seed,
            "shuffle": self.shuffle_mode,
            "drop_last": self.drop_last if drop_last is None else bool(drop_last),
        }
        if self.shuffle_mode == "block":
            fp["block_shards"] = self.block_shards
        source = getattr(self._source, "fingerprint", None)
        if isinstance(source, str):
            fp["source"] = source
        if hasattr(self._source, "source_state"):
            # a planned source (a Mix) checks its own state: its length may change at an
            # epoch boundary (new samples_per_epoch)
            del fp["num_samples"]
        return fp

    def state_dict(self, samples_received: int | None = None) -> dict[str, Any]:
        """The position in the dataset's own pass as a small JSON-serialisable dict.

        With ``evenly.DataLoader`` use ``loader.state_dict()``.  Here, the position is
        ``samples_received`` (samples this rank's loop received in the pass), by default
        the samples this process's iterator yielded, which is exact with
        ``num_workers=0``.  Inside a DataLoader worker (as torchdata's
        ``StatefulDataLoader`` calls it) the state also records that worker's progress.
        """
        info = get_worker_info()
        if info is not None:
            spec = self._own_spec(info.id, info.num_workers, count=False)
            # the pass's start (a planned source, a Mix, adds its part), never past it
            state = self.state_at(spec.epoch, spec.start, spec.num_samples + 1)
            state["worker"] = {
                "id": info.id,
                "num_workers": info.num_workers,
                "yielded": self._yielded,
            }
            return state
        plan = self.plan()
        received = self._yielded if samples_received is None else samples_received
        received = check_int("samples_received", received, minimum=0)
        position = plan.consumed_after(received // plan.batch_size)
        if received >= plan.samples_per_rank:
            position = plan.end
        return self.state_at(plan.epoch, position, plan.end)

    def state_at(
        self,
        epoch: int,
        position: int,
        end: int,
        batches: int = 0,
        drop_last: bool | None = None,
    ) -> dict[str, Any]:
        """A state at ``position`` of ``epoch`` (the next epoch's start once past ``end``);
        ``batches``: what this rank's loop had received in that epoch."""
        if position >= end:  # the pass is over: the state points at the next epoch
            epoch, position, batches = epoch + 1, 0, 0
        state = make_state(self.fingerprint(drop_last), epoch, position, batches)
        source_state = getattr(self._source, "source_state", None)
        if source_state is not None:
            state["source_state"] = source_state(epoch, position)
        return state

    def check_state(
        self, state: dict[str, Any], drop_last: bool | None = None
    ) -> tuple[int, int, int]:
        """Validate ``state`` for this dataset: (epoch, position, batches received).

        A planned source (a Mix) validates and takes its part (``source_state``)."""
        fingerprint = self.fingerprint(drop_last)
        load = getattr(self._source, "load_source_state", None)
        if load is not None:
            fingerprint["num_samples"] = len(self._source)
            state = {**state, "num_samples": len(self._source)}
        epoch, position, batches = check_state(state, fingerprint)
        if load is not None:
            load(state.get("source_state"), epoch, position)
        return epoch, position, batches

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume the dataset's own passes from ``state``: the next pass continues with
        the first sample not yet consumed, under any number of ranks, workers or batch
        size (``evenly.DataLoader`` users: ``loader.load_state_dict``).

        Raises ``evenly.StateError`` naming every field that does not match.
        """
        epoch, position, _ = self.check_state(state)
        worker = state.get("worker")
        info = get_worker_info()
        if isinstance(worker, dict) and info is not None:
            if (worker.get("id"), worker.get("num_workers")) != (info.id, info.num_workers):
                raise StateError(
                    f"worker state of worker {worker.get('id')} of {worker.get('num_workers')} "
                    f"loaded into worker {info.id} of {info.num_workers}"
                )
            skip = check_int("state['worker']['yielded']", worker.get("yielded"), minimum=0)
            self._counter.rebase(info.id, epoch, position)
            self._local_skip = skip
            return
        self._counter.reset(epoch, position)
        self._skipped.zero_()
