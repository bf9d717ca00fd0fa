"""A fixture for tests that touch HF Accelerate's process-global state."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def fresh_accelerate() -> Iterator[None]:
    """Each test starts and ends with Accelerate's process-global state uninitialised."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
