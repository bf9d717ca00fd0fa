"""HF Accelerate's ``skip_first_batches`` over an ``evenly.DataLoader``, made exact.

For a loader it did not wrap, Accelerate builds a ``SkipDataLoader`` from
``loader.dataset``: a torch DataLoader over the dataset (with the loader's batch size and
workers) that reads and drops the first ``k`` batches.  Left alone, that reads the
dataset's own passes (other batches than the evenly.DataLoader's), and after
``accelerator.load_state()`` (which already positioned the loader) it skips the received
batches a second time.

So while a ``SkipDataLoader`` iterates an evenly.DataLoader's dataset, :func:`skipping`
tells the dataset (through :class:`evenly.runtime.hooks.PassHooks`) how many batches it
drops, and the dataset serves its owner's pass instead: planned by the owner
(:mod:`evenly.loader.delegated`), read by :mod:`evenly.runtime.delegation`.

Accelerate is never imported here: only looked up if the program already imported it;
what this relies on (``SkipDataLoader`` calls ``begin()``, so ``GradientState`` names it
while it runs, and its ``skip_batches``) is pinned by ``tests/test_accelerate_internals.py``.
"""

from __future__ import annotations

from evenly.interop.accelerate import _active, _loaders, find_path

__all__ = ["skipping"]


def skipping(dataset: object) -> int | None:
    """The batches Accelerate's ``SkipDataLoader`` drops, if one is iterating ``dataset``
    in this process (what ``skip_first_batches`` builds for a loader it did not wrap)."""
    loaders, active = _loaders(), _active()
    skip = None if loaders is None else getattr(loaders, "SkipDataLoader", None)
    if skip is None or not isinstance(active, skip):
        return None
    if find_path(active, dataset) is None:
        return None
    return int(getattr(active, "skip_batches", 0))
