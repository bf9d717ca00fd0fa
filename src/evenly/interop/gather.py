"""HF Accelerate's ``gather_for_metrics`` over an ``evenly.DataLoader``.

Accelerate keeps an ``evenly.DataLoader`` as it is, so it does not know where the
epoch ends or how many rows of the last gathered batch are padding: its own loaders tell
it through the process-global ``GradientState`` (``DataLoaderStateMixin``): the loader
being iterated is its ``active_dataloader``, whose ``end_of_dataloader`` turns True as
the last batch is handed out and whose ``remainder`` is the number of real rows in the
gathered last batch (the ranks' last batches concatenated in rank order), which
``gather_for_metrics`` keeps (``[:remainder]``).  An ``evenly.DataLoader`` tells it the
same (:class:`EpochEnd`), pinned by ``tests/test_accelerate_internals.py``.

That truncation keeps a prefix, so it is exact only where the padding is the end of the
gathered batch: evenly deals the last step's positions round robin, so the repeats are
the last rows of the last ranks' batches, a suffix when there is one (always with two
ranks) and not always with more.  Where it is not, the loader warns once instead (under
the default pad) and Accelerate keeps every row (``remainder=-1``).
Accelerate is never imported here: only looked up if the program already imported it.
"""

from __future__ import annotations

import sys
import warnings
import weakref
from typing import Any

import numpy as np

from evenly.core.plan import EpochPlan
from evenly.errors import EvenlyWarning

__all__ = ["EpochEnd", "epoch_end", "gathered_remainder", "initialised", "warn_gather"]


def initialised() -> bool:
    """Whether Accelerate is in use in this process (its shared state initialised), so
    a loader's batches may meet ``gather_for_metrics``."""
    state = sys.modules.get("accelerate.state")
    return state is not None and bool(state.GradientState._shared_state)


def gathered_remainder(plan: EpochPlan) -> int | None:
    """The real rows of the pass's last step as ``gather_for_metrics`` gathers it (the
    ranks' last batches in rank order): 0 when none is padding, None when the padding is
    not its last rows (no prefix holds exactly the real ones).

    >>> gathered_remainder(EpochPlan(num_samples=13, world_size=2, batch_size=4))
    5
    >>> gathered_remainder(EpochPlan(num_samples=16, world_size=2, batch_size=4)), \\
    ... gathered_remainder(EpochPlan(num_samples=13, world_size=4, batch_size=4))
    (0, None)
    """
    if plan.num_padded == 0 or plan.num_batches == 0:
        return 0
    last = plan.num_batches - 1
    pads = np.concatenate(
        [plan.pads(plan.batch_positions(r, last)) for r in range(plan.world_size)]
    )
    real = int((~pads).sum())
    return real if not pads[:real].any() else None


class EpochEnd:
    """What Accelerate's ``GradientState`` reads from the loader it is iterating, for one
    pass of an ``evenly.DataLoader``: registered as its active loader at the pass start,
    ``end_of_dataloader`` set as the last batch is handed out, removed at the end (or
    when the pass is dropped)."""

    def __init__(self, state: Any, remainder: int) -> None:
        self.end_of_dataloader = False
        self.remainder = remainder
        self._state: Any = state
        state._add_dataloader(self)  # held weakly there: the pass's iterator holds it

    def last(self) -> None:
        """The batch being handed out is the pass's last."""
        self.end_of_dataloader = True

    def leave(self) -> None:
        """The pass ended (or was dropped): no longer the loader being iterated."""
        state, self._state = self._state, None
        if state is not None:
            state._remove_dataloader(self)


def _remainder(plan: EpochPlan) -> tuple[int | None, str]:
    """:func:`gathered_remainder` where Accelerate gathers over the plan's ranks (its
    processes are the plan's ranks), else None; and why it is None."""
    state = sys.modules["accelerate.state"]
    partial = state.PartialState
    processes = partial().num_processes if partial._shared_state else None
    if processes != plan.world_size:
        return None, (
            f"the plan is split over {plan.world_size} rank(s) but Accelerate gathers "
            f"over {processes} process(es)"
        )
    return gathered_remainder(plan), (
        f"over {plan.world_size} ranks they are not the last rows of the gathered last "
        f"batch, the only ones it can drop"
    )


def epoch_end(plan: EpochPlan, pad: str, owner: object) -> EpochEnd | None:
    """Under Accelerate, the :class:`EpochEnd` of a pass of ``plan`` (left when
    ``owner``, the pass's iterator, is collected); None without Accelerate, and under
    ``pad="none"`` (the ranks may end at different steps: nothing to tell)."""
    if pad == "none" or not initialised():
        return None
    remainder, _ = _remainder(plan)
    state = sys.modules["accelerate.state"].GradientState()
    end = EpochEnd(state, -1 if remainder is None else remainder)
    weakref.finalize(owner, end.leave)
    return end


def warn_gather(plan: EpochPlan, pad: str) -> bool:
    """Under Accelerate, warn that ``gather_for_metrics`` keeps an epoch's padding
    repeats of an ``evenly.DataLoader`` where they are not the last rows of the gathered
    last batch (all that Accelerate can drop); return whether it warned (the loader
    warns once)."""
    if not (plan.num_padded and pad == "repeat" and initialised()):
        return False
    remainder, why = _remainder(plan)
    if remainder is not None:
        return False
    warnings.warn(
        f"evenly: under HF Accelerate, accelerator.gather_for_metrics() keeps the "
        f"{plan.num_padded} repeated sample(s) of this epoch ({why}); for evaluation, "
        f"build the dataset with pad='mask' "
        f"(evenly.is_padding() marks them) or pad='none'",
        EvenlyWarning,
        stacklevel=4,
    )
    return True
