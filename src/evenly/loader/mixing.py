"""Online mixing under ``evenly.DataLoader``: ``set_weights`` restarts the pass in progress
at the position the loop reached, with the Mix's new weights from there (the change is a
pass state, as if saved, changed and loaded).  And what ``infinite=True`` refuses."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from evenly.core.plan import EpochPlan

if TYPE_CHECKING:
    from evenly.dataset import Dataset
    from evenly.loader.loader import DataLoader

__all__ = ["refuse_planned_source", "set_weights"]


def refuse_planned_source(dataset: Dataset[Any]) -> None:
    """A source that plans its own epochs (an ``evenly.Mix``) lays its steps out from each
    epoch's start, which a stream of epochs does not keep: refused until it can."""
    if dataset._planner.view.planned is not None:
        raise ValueError(
            f"evenly.DataLoader(infinite=True) does not support a "
            f"{type(dataset.source).__name__} source yet: its per-step proportions and its "
            f"resume are defined per epoch, and a stream of epochs would silently repeat or "
            f"skip samples; train a Mix epoch by epoch (infinite=False)"
        )


def set_weights(loader: DataLoader, weights: Mapping[str, float]) -> None:
    """See :meth:`evenly.DataLoader.set_weights`."""
    if loader.infinite:
        raise ValueError(
            "evenly.DataLoader(infinite=True) does not support a Mix, so it has no weights to set"
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
