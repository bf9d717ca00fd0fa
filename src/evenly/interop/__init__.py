"""Framework interop by contract: one module per framework whose objects evenly must
recognise (HF Accelerate, and so the HF Trainer), each pinned by an internals test.

The layers below never import this package: importing it (``import evenly`` does)
registers its hooks with them (:mod:`evenly.runtime.hooks`).  It stays light: a
framework module of evenly's is imported only once the program imported that framework.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from evenly.core.plan import EpochPlan
from evenly.runtime.hooks import PassHooks, PassWatcher, Wrapped, register

__all__ = ["AccelerateHooks"]


def _accelerate_in_use() -> bool:
    """Whether the program imported Accelerate's loaders (evenly never imports it)."""
    return "accelerate.data_loader" in sys.modules


class AccelerateHooks(PassHooks):
    """HF Accelerate's wrappers (and so the HF Trainer's loader): :mod:`.accelerate`,
    :mod:`.skip` and :mod:`.gather`, looked at only once Accelerate is imported."""

    def driving(self, dataset: object) -> Wrapped | None:
        if not _accelerate_in_use():
            return None
        from evenly.interop import accelerate

        return accelerate.driving(dataset)

    def before_pass(self, dataset: object) -> None:
        if _accelerate_in_use():
            from evenly.interop import accelerate

            accelerate.before_pass(dataset)

    def check_pass(self, dataset: object, worker_dataset: object, snapshot: Wrapped | None) -> None:
        if snapshot is None and not _accelerate_in_use():
            return  # (a spawned worker that unpickled a wrapper imported Accelerate)
        from evenly.interop import accelerate

        accelerate.check_pass(dataset, worker_dataset, snapshot)

    def skipping(self, dataset: object) -> int | None:
        if not _accelerate_in_use():
            return None
        from evenly.interop import skip

        return skip.skipping(dataset)

    @property
    def warn_padded(self) -> Callable[[EpochPlan, str], bool]:
        from evenly.interop import gather

        return gather.warn_gather

    def watch_pass(self, plan: EpochPlan, pad: str, owner: object) -> PassWatcher | None:
        if "accelerate.state" not in sys.modules:
            return None
        from evenly.interop import gather

        return gather.epoch_end(plan, pad, owner)


register(AccelerateHooks())
