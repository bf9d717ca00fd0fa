"""An ``evenly.DataLoader``'s pass read by another loader through its dataset (HF
Accelerate's ``skip_first_batches`` over a loader it did not wrap), planned here, in the
owner: the reading is :mod:`evenly.runtime.delegation`'s.

- With a loaded state that positioned the owner: the rest of that pass, when ``k`` is the
  number of batches the state says were received (a clear error otherwise);
- without one: the owner's next pass from its ``k``-th batch on, the rest of the
  uninterrupted run.

The owner then learns (a shared flag) that the epoch was consumed and goes on with the
next one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from evenly.core.passes import PassTracker
from evenly.core.spec import PassSpec
from evenly.core.state import PassState
from evenly.runtime.delegation import Delegation
from evenly.runtime.planner import Planner

__all__ = ["after_delegated", "plan_delegation"]


def plan_delegation(
    planner: Planner,
    passes: PassTracker,
    spec_of: Callable[[PassState], PassSpec],
    drop: bool,
    done: torch.Tensor,
    k: int,
) -> Delegation:
    """The owner's pass under ``skip_first_batches(owner, k)``: ``passes`` its tracker,
    ``spec_of`` its spec of a pass start, ``drop`` its ``drop_last``, ``done`` its
    shared flag."""
    start = passes.next_start()
    if start.resumes:  # a loaded state positioned the owner
        if start.batches != k:
            raise RuntimeError(
                f"evenly: skip_first_batches(loader, {k}) over an evenly.DataLoader whose "
                f"loaded state says {start.batches} batch(es) of epoch {start.epoch} were "
                f"received: skipping {k} would lose or repeat samples. After "
                f"accelerator.load_state(), iterate the evenly.DataLoader itself (it "
                f"continues with the first batch not received), or skip exactly "
                f"{start.batches}"
            )
        rest = start
    else:
        epoch_start = spec_of(start)
        plan = planner.plan_for(epoch_start)
        have = plan.rank_batches(epoch_start.rank)
        if k > have:
            raise ValueError(
                f"evenly: skip_first_batches(loader, {k}), but this rank has {have} "
                f"batch(es) in epoch {start.epoch}"
            )
        rest = _after(planner, start, plan.consumed_after(k), k, plan.order, drop) if k else start
    first = spec_of(PassState(rest.epoch, 0, 0, passes.next_start().source))
    return Delegation(spec_of(rest), first, k, done)


def _after(
    planner: Planner, start: PassState, position: int, k: int, order: Any, drop: bool
) -> PassState:
    """The state after ``k`` batches of the pass from ``start`` (a Mix adds its part, as
    a checkpoint there would)."""
    saved = planner.to_state(PassState(start.epoch, position, k, start.source), drop, order)
    return planner.from_state(saved, drop)


def after_delegated(passes: PassTracker, done: torch.Tensor) -> None:
    """In the owner (main process): if a delegated pass consumed the epoch its next pass
    would start, the next pass is the following epoch."""
    epoch = int(done[0])
    if epoch >= 0:
        done[0] = -1
        if passes.current is None and passes.next_start().epoch == epoch:
            passes.set_epoch(epoch + 1)
