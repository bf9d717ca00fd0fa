"""What each pass of an ``evenly.DataLoader`` runs on, decided at its start: columnar
reads or per-sample ones, reader threads or worker processes; and the loader settings
refused outright."""

from __future__ import annotations

from typing import Any

from torch.utils.data import default_collate

from evenly.loader.threads import thread_safety_problem
from evenly.options import WORKER_TYPES, WorkerType
from evenly.runtime.planner import Planner
from evenly.runtime.token_mix import is_token_mix

__all__ = [
    "WORKER_TYPES",
    "WorkerType",
    "check_worker_type",
    "refuse_planned_source",
    "use_columns",
    "use_threads",
]


def refuse_planned_source(planner: Planner) -> None:
    """A source that plans its own epochs (an ``evenly.Mix``) lays its steps out from each
    epoch's start, which a stream of epochs does not keep: refused until it can.  A Mix
    by tokens is not: its order is planned per epoch whatever the step."""
    if planner.view.planned is not None and not is_token_mix(planner.source):
        raise ValueError(
            f"evenly.DataLoader(infinite=True) does not support a "
            f"{type(planner.source).__name__} source yet: its per-step proportions and its "
            f"resume are defined per epoch, and a stream of epochs would silently repeat or "
            f"skip samples; train a Mix epoch by epoch (infinite=False)"
        )


def use_columns(
    choice: bool | None, batch_size: int | None, planner: Planner, collate: Any
) -> bool:
    """Whether the pass reads with the source's ``read_columns`` (``columnar=``)."""
    if choice is False or batch_size is None:
        return False
    view = planner.view
    if choice is True:
        if view.read_columns is None:
            raise TypeError(
                f"evenly.DataLoader(columnar=True): {type(view.source).__name__} has no "
                f"read_columns(); use an Arrow-backed source (evenly.from_arrow, "
                f"from_parquet) or columnar=None"
            )
        return True
    return view.columnar_exact and planner.transform is None and collate in (None, default_collate)


def check_worker_type(worker_type: WorkerType, kwargs: dict[str, Any]) -> WorkerType:
    """Validate ``worker_type=`` (raising where threads are asked for and unsafe)."""
    if worker_type not in WORKER_TYPES:
        raise ValueError(f"worker_type must be one of {list(WORKER_TYPES)}, got {worker_type!r}")
    if worker_type == "thread" and kwargs.get("worker_init_fn") is not None:
        raise ValueError(
            "evenly.DataLoader(worker_type='thread'): worker_init_fn runs in worker "
            "processes; use worker_type='process' (or drop worker_init_fn)"
        )
    return worker_type


def use_threads(
    worker_type: str, num_workers: int, planner: Planner, columnar: bool, kwargs: Any
) -> bool:
    """Whether reader threads read this pass: asked for (``"thread"``: raises if the
    per-sample seeding makes it unsafe), or ``"auto"`` where it is safe and the reads
    release the GIL (columnar: no per-sample Python; packing over a source that reads token
    ids, without a transform) and nothing else needs processes."""
    if num_workers == 0 or worker_type == "process":
        return False
    problem = thread_safety_problem(
        planner.transform, planner.seed_generators, kwargs.get("worker_init_fn")
    )
    if worker_type == "thread":
        if problem is not None:
            raise ValueError(f"evenly.DataLoader(worker_type='thread'): {problem}")
        return True
    watched = planner.tap is not None or planner.rows_tap is not None  # the audit
    return problem is None and (columnar or _direct_packing(planner)) and not watched


def _direct_packing(planner: Planner) -> bool:
    """A packed pass whose reads are token gathers (a source that reads token ids, no
    transform, no tokenizer): numpy and memory-map copies that need no process each."""
    packer = planner.packer
    return (
        packer is not None
        and packer.packing.tokenize is None
        and planner.transform is None
        and planner.view.read_tokens is not None
    )
