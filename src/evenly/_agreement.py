"""Plan agreement across DDP ranks: one small collective at the start of each epoch.

Ranks that disagree on the seed, the dataset size or the batch size do not fail: they
silently train on overlapping data, or hang when one of them has an extra batch.  So at
the start of each epoch every rank shares its view of the plan, and every rank raises
the same error naming the fields and ranks that differ.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

__all__ = ["PlanMismatchError", "check_agreement", "disagreements"]


class PlanMismatchError(RuntimeError):
    """DDP ranks disagree on the epoch's plan: they would duplicate data or hang."""


def disagreements(views: list[dict[str, Any]]) -> list[str]:
    """Describe each field on which the ranks' views differ (pure; ``views[r]`` is rank
    r's).  Also checks that the ranks claim distinct ranks of the right world size."""
    problems = []
    fields = sorted({key for view in views for key in view if key != "rank"})
    for field in fields:
        by_value: dict[str, list[int]] = defaultdict(list)
        for rank, view in enumerate(views):
            by_value[repr(view.get(field))].append(rank)
        if len(by_value) > 1:
            parts = "; ".join(
                f"{_ranks(ranks)} {value}"
                for value, ranks in sorted(by_value.items(), key=lambda kv: kv[1][0])
            )
            problems.append(f"{field}: {parts}")
    claimed = [view.get("rank") for view in views]
    if sorted(claimed, key=str) != list(range(len(views))):
        problems.append(
            f"rank: process group ranks 0..{len(views) - 1} claim data ranks {claimed} "
            f"(each must take its own rank; pass rank=None to use torch.distributed's)"
        )
    sizes = {view.get("world_size") for view in views}
    if sizes != {len(views)}:
        problems.append(
            f"world_size: the process group has {len(views)} ranks but the plan says "
            f"{sorted(sizes, key=str)}"
        )
    return problems


def _ranks(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]} has"
    return f"ranks {', '.join(map(str, ranks))} have"


def check_agreement(view: dict[str, Any]) -> None:
    """Gather every rank's view of the plan (all_gather_object on the default group) and
    raise ``PlanMismatchError`` on every rank if they differ."""
    import torch.distributed as dist

    views: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(views, view)
    problems = disagreements(views)
    if problems:
        raise PlanMismatchError(
            "evenly: the DDP ranks disagree on the plan of epoch "
            f"{view.get('epoch')}, so they would read overlapping data or hang: "
            + " | ".join(problems)
            + ". Build the dataset identically on every rank (same source, seed, "
            "shuffle, drop_last, batch_size), or switch this check off with "
            "evenly.DataLoader(..., check_plan=False)."
        )
