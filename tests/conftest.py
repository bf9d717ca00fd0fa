"""Shared fixtures: a clean environment for every test (no RANK/WORLD_SIZE leaking in)."""

from __future__ import annotations

import pytest

_DIST_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
)


@pytest.fixture(autouse=True)
def clean_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    """Scrub torchrun's variables so each test states its own topology."""
    for name in _DIST_VARS:
        monkeypatch.delenv(name, raising=False)
