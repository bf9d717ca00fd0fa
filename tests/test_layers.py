"""The layers as a contract: the import graph is checked by import-linter (pyproject.toml,
``[tool.importlinter]``, run by scripts/test); here, what it cannot see: no frame
inspection anywhere, and framework adapters reaching the dataset only through the hooks
they register (:mod:`evenly.runtime.hooks`)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

import evenly
from evenly.runtime import hooks
from evenly.runtime.hooks import PassHooks, Wrapped

SRC = Path(evenly.__file__).resolve().parent

#: what looking at a caller's frames takes: sys._getframe, a frame's f_back/f_locals/
#: f_globals, a traceback's tb_frame, and inspect's frame functions
FRAME_ATTRIBUTES = {"_getframe", "f_back", "f_locals", "f_globals", "tb_frame"}
INSPECT_FRAMES = {"currentframe", "stack", "getouterframes", "getinnerframes", "trace"}


def _frame_use(node: ast.AST) -> str | None:
    if isinstance(node, ast.Attribute):
        if node.attr in FRAME_ATTRIBUTES:
            return node.attr
        on_inspect = isinstance(node.value, ast.Name) and node.value.id == "inspect"
        return node.attr if on_inspect and node.attr in INSPECT_FRAMES else None
    if isinstance(node, ast.ImportFrom) and node.module in ("sys", "inspect"):
        wanted = FRAME_ATTRIBUTES | INSPECT_FRAMES
        return next((a.name for a in node.names if a.name in wanted), None)
    return None


def test_no_module_of_evenly_looks_at_a_frame() -> None:
    found = []
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            name = _frame_use(node)
            if name is not None:
                found.append(f"{path.relative_to(SRC)}:{getattr(node, 'lineno', 0)} {name}")
    assert found == []


@pytest.fixture
def only(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[PassHooks]]:
    """The registered hooks, replaced for one test by the list it fills."""
    registered: list[PassHooks] = []
    monkeypatch.setattr(hooks, "_REGISTERED", registered)
    yield registered


class Dispatching(PassHooks):
    """A framework whose loader reads the whole epoch on rank 0 in batches of 4."""

    def __init__(self) -> None:
        self.passes: list[object] = []

    def driving(self, dataset: object) -> Wrapped | None:
        return Wrapped("dispatch", 4)

    def before_pass(self, dataset: object) -> None:
        self.passes.append(dataset)


def test_importing_evenly_registers_the_accelerate_adapter() -> None:
    from evenly.interop import AccelerateHooks

    assert any(type(h) is AccelerateHooks for h in hooks.registered())


def test_with_no_adapter_registered_the_dataset_reads_its_own_passes(
    only: list[PassHooks],
) -> None:
    ds = evenly.Dataset(list(range(10)), shuffle=True, seed=1, rank=1, world_size=2)
    ds.set_epoch(0)
    assert len(ds) == 5
    assert len(list(ds)) == 5


def test_a_registered_adapter_drives_the_dataset_through_its_hooks(
    only: list[PassHooks],
) -> None:
    """The dataset asks the registered hooks, never a framework module: an adapter that
    says its loader dispatches gets rank 0's whole epoch, and sees every pass start."""
    adapter = Dispatching()
    hooks.register(adapter)
    hooks.register(adapter)  # once per type
    assert hooks.registered() == (adapter,)
    ds = evenly.Dataset(list(range(10)), shuffle=True, seed=1, rank=1, world_size=2)
    ds.set_epoch(0)
    assert adapter.passes == [ds]
    assert len(ds) == 10
    assert sorted(int(x) for x in ds) == list(range(10))
    only.clear()
    assert len(ds) == 5  # the adapter gone: this rank's share again
