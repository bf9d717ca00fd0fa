"""HF Accelerate's ``skip_first_batches`` over an ``evenly.DataLoader``.

For a loader it did not wrap, Accelerate builds a ``SkipDataLoader`` from
``loader.dataset``: a torch DataLoader over the dataset's own passes that drops the first
``k`` batches.  Over an ``evenly.DataLoader``'s dataset that reads other batches than the
evenly.DataLoader would, and after ``accelerator.load_state()`` (which already positioned
the loader) it skips the received batches a second time.  Until it can be made exact,
it is refused, before the first batch, naming the fix.  Accelerate is never imported
here: only looked up if the program already imported it; what this relies on
(``SkipDataLoader`` calls ``begin()``, so ``GradientState`` names it while it runs) is
pinned by ``tests/test_accelerate_internals.py``.
"""

from __future__ import annotations

from evenly.interop.accelerate import _active, _loaders, find_path

__all__ = ["refuse_skip_loader"]


def refuse_skip_loader(dataset: object) -> None:
    """Raise if Accelerate's ``SkipDataLoader`` (what ``skip_first_batches`` builds for
    a loader it did not wrap, such as an ``evenly.DataLoader``) is iterating ``dataset``:
    it reads the dataset's own passes, not the evenly.DataLoader's batches, and after
    ``load_state`` it skips the received batches a second time."""
    loaders, active = _loaders(), _active()
    skip = None if loaders is None else getattr(loaders, "SkipDataLoader", None)
    if skip is None or not isinstance(active, skip):
        return
    if find_path(active, dataset) is None:
        return
    raise RuntimeError(
        "evenly: accelerate's skip_first_batches() rebuilt a loader from an "
        "evenly.DataLoader's dataset: it would read other batches than the "
        "evenly.DataLoader and, after accelerator.load_state(), skip the received batches "
        "a second time (samples lost). Iterate the evenly.DataLoader itself: after "
        "load_state() it continues with the first batch not received (len() counts the "
        "received ones); to skip k batches without a checkpoint, load a state from "
        "loader.state_dict() taken after k batches"
    )
