"""No saved order changes: the code reproduces every order in ``tests/data/order_pins.json``.

The file was recorded from the code before the Dataset's and the Mix's Feistel networks
became one (``tests/order_pins.py`` says how); it is the spec, never re-recorded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.order_pins import KINDS, digest

PINS: dict[str, list[dict[str, Any]]] = json.loads(
    (Path(__file__).parent / "data" / "order_pins.json").read_text()
)


def test_every_kind_is_pinned() -> None:
    assert set(PINS) == set(KINDS)
    for kind, (cases, _) in KINDS.items():
        assert [entry["case"] for entry in PINS[kind]] == cases(), kind


@pytest.mark.parametrize(
    ("kind", "index"), [(kind, i) for kind, entries in PINS.items() for i in range(len(entries))]
)
@pytest.mark.filterwarnings("ignore:evenly. .* repeated:evenly.errors.EvenlyWarning")
def test_the_pinned_order_is_reproduced(kind: str, index: int) -> None:
    entry = PINS[kind][index]
    _, compute = KINDS[kind]
    got = digest(compute(entry["case"]))
    assert got == {k: entry[k] for k in ("len", "sha256", "head")}, entry["case"]
