"""HF Accelerate's ``gather_for_metrics`` over an ``evenly.DataLoader``.

Accelerate drops the padding of a distributed evaluation only for loaders it rebuilt
(it keeps an ``evenly.DataLoader`` as it is), so an epoch padded with repeats
(``pad="repeat"``, the default) is gathered with them: the loader says so, once.
Accelerate is never imported here: only looked up if the program already imported it.
"""

from __future__ import annotations

import sys
import warnings

from evenly.errors import EvenlyWarning

__all__ = ["initialised", "warn_gather"]


def initialised() -> bool:
    """Whether Accelerate is in use in this process (its shared state initialised), so
    a loader's batches may meet ``gather_for_metrics``."""
    state = sys.modules.get("accelerate.state")
    return state is not None and bool(state.GradientState._shared_state)


def warn_gather(num_padded: int, pad: str) -> bool:
    """Under Accelerate, warn that ``gather_for_metrics`` keeps an epoch's padding
    repeats of an ``evenly.DataLoader`` (it drops a remainder only for loaders it
    rebuilt); return whether it warned (the loader warns once)."""
    if not (num_padded and pad == "repeat" and initialised()):
        return False
    warnings.warn(
        f"evenly: under HF Accelerate, accelerator.gather_for_metrics() keeps the "
        f"{num_padded} repeated sample(s) of this epoch (it drops a remainder only for "
        f"loaders it rebuilt): for evaluation, build the dataset with pad='mask' "
        f"(evenly.is_padding() marks them) or pad='none'",
        EvenlyWarning,
        stacklevel=4,
    )
    return True
