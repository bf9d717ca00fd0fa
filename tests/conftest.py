"""Shared fixtures: a clean environment for every test (no RANK/WORLD_SIZE leaking in), and
one node-local cache directory for the session (decoded rows, lengths, packing plans and
manifests never go to the user's ~/.cache)."""

from __future__ import annotations

import os
from collections.abc import Iterator

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


@pytest.fixture(autouse=True, scope="session")
def session_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """``$EVENLY_CACHE_DIR`` for the whole session (spawned ranks and workers inherit
    it); tests that need a cache of their own pass ``cache_dir=``."""
    old = os.environ.get("EVENLY_CACHE_DIR")
    os.environ["EVENLY_CACHE_DIR"] = str(tmp_path_factory.mktemp("evenly-cache"))
    yield
    if old is None:
        os.environ.pop("EVENLY_CACHE_DIR", None)
    else:
        os.environ["EVENLY_CACHE_DIR"] = old
