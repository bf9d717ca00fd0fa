"""``import evenly`` stays light, and the audit's modules import one another without a cycle.

Each import check runs in a fresh interpreter, so what other tests imported does not count.
"""

from __future__ import annotations

import ast
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

AUDIT = Path(__file__).resolve().parents[1] / "src" / "evenly" / "audit"

#: Modules ``import evenly`` must not load: plotting and terminal tables, and the audit's
#: rank runner, tracing wrappers, process control, report, table and CLI.
HEAVY = (
    "matplotlib",
    "rich",
    "evenly.audit._collect",
    "evenly.audit._trace",
    "evenly.audit._launch",
    "evenly.audit._report",
    "evenly.audit._table",
    "evenly.audit._cli",
)


def _modules_after(code: str) -> list[str]:
    """The module names in ``sys.modules`` after running ``code`` in a fresh interpreter."""
    script = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr
    names: list[str] = json.loads(proc.stdout.strip().splitlines()[-1])
    return names


def _heavy(names: list[str]) -> list[str]:
    return [m for m in names if any(m == h or m.startswith(h + ".") for h in HEAVY)]


def test_import_evenly_loads_no_plotting_tables_or_audit_runner() -> None:
    names = _modules_after("import evenly\nassert callable(evenly.audit.run)")
    assert "evenly" in names
    assert _heavy(names) == []


def test_the_audit_package_and_its_public_names_are_cheap_to_import() -> None:
    names = _modules_after(
        "from evenly.audit import AuditError, AuditResult, Finding, Records, audit_many, run"
    )
    assert _heavy(names) == []


def test_every_public_name_of_evenly_audit_resolves() -> None:
    package = importlib.import_module("evenly.audit")
    for name in package.__all__:
        assert getattr(package, name) is not None, name
    assert set(package.__all__) <= set(dir(package))
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        _ = package.nope


def test_evenly_audit_is_the_module_and_run_its_entry_after_its_modules_load() -> None:
    names = _modules_after(
        "import sys, evenly\nfrom evenly.audit import AuditError\nimport evenly.audit._api\n"
        "from evenly.audit._api import run\n"
        "assert evenly.audit is sys.modules['evenly.audit'], evenly.audit\n"
        "assert evenly.audit.run is run"
    )
    assert "evenly.audit._api" in names


def _imports(path: Path) -> set[str]:
    """The sibling modules ``path`` imports (``from ._x import``), anywhere in the file:
    at the top, under ``TYPE_CHECKING`` or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                found.add(node.module)
            else:
                found.update(alias.name for alias in node.names)
    return found


def test_the_audit_modules_import_one_another_without_a_cycle() -> None:
    graph = {p.stem: _imports(p) for p in AUDIT.glob("*.py")}
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            cycle = [*path[path.index(module) :], module]
            pytest.fail(f"import cycle in evenly.audit: {' -> '.join(cycle)}")
        if module in done or module not in graph:
            return
        for target in sorted(graph[module]):
            visit(target, [*path, module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])


CORE = Path(__file__).resolve().parents[1] / "src" / "evenly" / "core"


def test_the_planning_core_imports_with_torch_blocked() -> None:
    """Every module of ``evenly.core`` (and ``import evenly`` itself) loads in an interpreter
    where ``import torch`` fails, and plans an epoch there."""
    modules = sorted(
        "evenly."
        + ".".join(p.relative_to(CORE.parent).with_suffix("").parts).removesuffix(".__init__")
        for p in CORE.rglob("*.py")
    )
    assert "evenly.core.plan" in modules and "evenly.core.permutation" in modules
    code = (
        "import sys\nsys.modules['torch'] = None\nimport importlib\nimport evenly\n"
        f"for name in {modules!r}:\n    importlib.import_module(name)\n"
        "from evenly.core.plan import EpochPlan\nfrom evenly.core.order import make_order\n"
        "plan = EpochPlan(num_samples=10, world_size=2, batch_size=2, seed=0, epoch=1,\n"
        "                 order=make_order('global', 10, seed=0, epoch=1))\n"
        "assert sorted(plan.indices(plan.rank_positions(0)).tolist()\n"
        "              + plan.indices(plan.rank_positions(1)).tolist()) == list(range(10))\n"
        "assert sys.modules['torch'] is None  # still blocked: nothing replaced the blocker"
    )
    names = _modules_after(code)
    assert "evenly.core.plan" in names
    assert not [m for m in names if m.startswith("torch.")]


def test_evenly_all_is_sorted_and_every_name_resolves() -> None:
    import evenly

    assert sorted(evenly.__all__) == evenly.__all__
    for name in evenly.__all__:
        assert getattr(evenly, name) is not None, name
    assert "PassSpec" not in evenly.__all__
