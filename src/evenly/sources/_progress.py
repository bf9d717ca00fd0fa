"""Progress bars for long work (``evenly write``, scans of many shards): tqdm, shown on
a terminal only, unless asked for or against.

``progress=None`` (the default everywhere) shows the bar when stderr is a terminal, on
one process only (rank 0 when ``RANK`` is set); the environment variable
``EVENLY_PROGRESS=1`` / ``0`` forces it on / off; ``True`` / ``False`` decide outright.

>>> with bar(3, "demo", show=False) as b:
...     b.update(3)
"""

from __future__ import annotations

import os
import sys
from typing import Any

from tqdm.auto import tqdm

__all__ = ["bar", "wanted"]


def wanted(show: bool | None) -> bool:
    """Whether to draw a bar (see the module's docstring)."""
    if show is not None:
        return bool(show)
    forced = os.environ.get("EVENLY_PROGRESS", "").strip().lower()
    if forced in ("1", "true", "yes", "on"):
        return True
    if forced in ("0", "false", "no", "off"):
        return False
    if os.environ.get("RANK", "0") != "0":
        return False
    return bool(getattr(sys.stderr, "isatty", lambda: False)())


def bar(
    total: int | None, desc: str, unit: str = "it", show: bool | None = None, leave: bool = True
) -> Any:
    """A tqdm bar (a no-op one unless :func:`wanted`); ``leave=False``: erased when done."""
    return tqdm(total=total, desc=desc, unit=unit, disable=not wanted(show), leave=leave)
