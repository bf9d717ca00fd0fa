"""Every error and warning evenly raises, and the argument checks that name the setting at
fault.  Pure Python: no torch, no numpy import at module level.

>>> check_int("batch_size", 0, minimum=1)
Traceback (most recent call last):
...
ValueError: batch_size must be >= 1, got 0
"""

from __future__ import annotations

import numbers

__all__ = ["EvenlyWarning", "PlanMismatchError", "StateError", "check_int"]


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
