"""Online mixing under ``evenly.DataLoader``: ``set_weights`` restarts the pass in progress
at the position the loop reached, with the Mix's new weights from there (the change is a
pass state, as if saved, changed and loaded)."""

from __future__ import annotations

from collections.abc import Mapping

from evenly.core.passes import PassTracker
from evenly.core.plan import EpochPlan
from evenly.core.stream import StreamPlan
from evenly.runtime.planner import Planner

__all__ = ["reweight"]


def reweight(
    planner: Planner,
    passes: PassTracker,
    plan: EpochPlan | StreamPlan | None,
    drop: bool,
    weights: Mapping[str, float],
) -> bool:
    """Load into ``passes`` (a loader's tracker; ``plan``: its pass's plan, ``drop``: its
    ``drop_last``) the state where the loop stands with the Mix's new ``weights``; return
    whether a pass was running (the loader restarts it there).  See
    :meth:`evenly.DataLoader.set_weights`."""
    running = passes.current is not None and isinstance(plan, EpochPlan)
    order = plan.order if running and isinstance(plan, EpochPlan) else None
    changed = planner.reweighted(passes.state(), weights, drop, order)
    passes.load(changed, planner.carried(changed))
    return running
