"""Every error and warning evenly raises, and the argument checks that name the setting at
fault.  Pure Python: no torch, no numpy import at module level.

>>> check_int("batch_size", 0, minimum=1)
Traceback (most recent call last):
...
ValueError: batch_size must be >= 1, got 0
"""

from __future__ import annotations

import numbers
import warnings

__all__ = [
    "EvenlyWarning",
    "PlanMismatchError",
    "StateError",
    "check_int",
    "check_timeout",
    "warn_deprecated",
]

#: The release that removes what is deprecated now.
REMOVED_IN = "0.3"


class EvenlyWarning(UserWarning):
    """Something about the epoch the user should know: padding, idle workers, no data."""


class StateError(ValueError):
    """A checkpoint state that cannot be loaded into this dataset or loader."""


class PlanMismatchError(RuntimeError):
    """DDP ranks disagree on the epoch's plan: they would duplicate data or hang."""


def check_int(name: str, value: object, *, minimum: int | None = None) -> int:
    """Return ``value`` as an int, or raise a clear error naming the setting."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_timeout(name: str, value: object) -> float | None:
    """Return ``value`` as seconds (> 0), or ``None`` (no timeout: the check is off)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{name} must be a number of seconds or None, got {value!r} ({type(value).__name__})"
        )
    seconds = float(value)
    if not seconds > 0:  # NaN too
        raise ValueError(f"{name} must be > 0 seconds (or None to switch it off), got {value}")
    return seconds


def warn_deprecated(old: str, new: str, *, stacklevel: int = 2) -> None:
    """A ``DeprecationWarning``: ``old`` works until evenly ``REMOVED_IN``; use ``new``.

    ``stacklevel`` counts from the caller of this function (2: its caller's caller).
    """
    warnings.warn(
        f"{old} is deprecated and will be removed in evenly {REMOVED_IN}: use {new}",
        DeprecationWarning,
        stacklevel=stacklevel + 1,
    )
