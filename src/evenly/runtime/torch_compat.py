"""Every private torch attribute evenly relies on, behind one small function each, pinned
by ``tests/test_torch_internals.py`` (checked against torch 2.13)."""

from __future__ import annotations

from typing import Any

__all__ = ["worker_base_seed"]


def worker_base_seed(worker: Any) -> int:
    """The base seed shared by every worker of one DataLoader iterator: torch seeds worker
    ``i`` with ``base_seed + i`` (``torch.utils.data._utils.worker._worker_loop``), and
    ``get_worker_info()`` reports that seed and ``i``."""
    return int(worker.seed) - int(worker.id)
