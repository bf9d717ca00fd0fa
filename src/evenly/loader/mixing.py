"""Online mixing under ``evenly.DataLoader``: ``set_weights`` restarts the pass in progress
at the position the loop reached, with the Mix's new weights from there (the change is a
pass state, as if saved, changed and loaded)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from evenly.core.plan import EpochPlan

if TYPE_CHECKING:
    from evenly.loader.loader import DataLoader

__all__ = ["set_weights"]


def set_weights(loader: DataLoader, weights: Mapping[str, float]) -> None:
    """See :meth:`evenly.DataLoader.set_weights`."""
    if loader.infinite:
        raise ValueError(
            "set_weights is not supported under evenly.DataLoader(infinite=True): a stream of "
            "epochs keeps the weights it started with (a Mix by samples is not streamed at "
            "all); train epoch by epoch to change them"
        )
    planner = loader.dataset._planner
    loader._follow_dataset()
    passes = loader._passes
    plan = loader._plan
    running = passes.current is not None and isinstance(plan, EpochPlan)
    order = plan.order if running and isinstance(plan, EpochPlan) else None
    changed = planner.reweighted(passes.state(), weights, loader._drop, order)
    passes.load(changed, planner.carried(changed))
    held = loader._engine.iterating()
    if running and held is not None:
        held.adopt(iter(loader))  # the loop goes on with the restarted pass
        loader._engine.follow(held)
