"""What each pass of an ``evenly.DataLoader`` runs on, decided at its start: columnar
reads or per-sample ones (then the planner's ``pass_strategy``), reader threads or worker
processes; and the loader settings refused outright."""

from __future__ import annotations

from typing import Any

from torch.utils.data import default_collate

from evenly.loader.threads import thread_safety_problem
from evenly.options import WORKER_TYPES, WorkerType
from evenly.runtime.planner import Planner
from evenly.runtime.strategy import ReadStrategy

__all__ = [
    "WORKER_TYPES",
    "WorkerType",
    "check_worker_type",
    "use_columns",
    "use_threads",
]


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
    worker_type: str, num_workers: int, planner: Planner, reads: ReadStrategy, kwargs: Any
) -> bool:
    """Whether reader threads read this pass (``reads``: its reader strategy): asked for
    (``"thread"``: raises if the per-sample seeding makes it unsafe), or ``"auto"`` where
    it is safe and the reads release the GIL (columnar: no per-sample Python; packing over
    a source that reads token ids, without a transform) and nothing else needs
    processes."""
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
    return problem is None and reads.releases_gil(planner) and not watched
