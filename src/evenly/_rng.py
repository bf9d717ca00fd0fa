"""Per-sample random streams for Python's ``random``, NumPy's global generator and torch's
default generator, kept apart from the user's own state.

Cost (measured in bench/bench_seeding.py): seeding the three generators is a few
microseconds per sample; saving and restoring the user's state is paid once per batch.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

__all__ = ["RngState", "seed_all"]

_MASK32 = 0xFFFFFFFF


def seed_all(seed: int) -> None:
    """Seed ``random``, NumPy's global generator and torch's default generator."""
    random.seed(seed)
    np.random.seed(seed & _MASK32)
    torch.default_generator.manual_seed(seed)


class RngState:
    """A snapshot of the three global generators, to put back after seeding them."""

    __slots__ = ("_numpy", "_python", "_torch")

    def __init__(self) -> None:
        self._python: Any = random.getstate()
        self._numpy: Any = np.random.get_state()
        self._torch = torch.default_generator.get_state()

    def restore(self) -> None:
        random.setstate(self._python)
        np.random.set_state(self._numpy)
        torch.default_generator.set_state(self._torch)
