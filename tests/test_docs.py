"""The ```python blocks in docs/*.md run as written (docs that are not run rot).

Blocks in doctest form (``>>>``) run under pytest's doctest collection instead; a block
whose first line is a ``# (sketch`` comment shows a part of a larger program and is only
compiled."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def blocks() -> list[tuple[str, str]]:
    out = []
    for path in sorted(DOCS.glob("*.md")):
        for i, code in enumerate(BLOCK.findall(path.read_text())):
            if ">>> " not in code:
                out.append((f"{path.name}#{i}", code))
    return out


@pytest.mark.parametrize(("where", "code"), blocks(), ids=[w for w, _ in blocks()])
def test_doc_block_runs(
    where: str, code: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("EVENLY_CACHE_DIR", str(tmp_path / "cache"))
    compiled = compile(code, where, "exec")
    if not code.startswith("# (sketch"):
        exec(compiled, {"__name__": "__doc_block__"})


def test_every_test_the_reliability_matrix_names_exists() -> None:
    """RELIABILITY.md names a test for each fault: each named file and test exists."""
    import re

    root = DOCS.parent
    text = (root / "RELIABILITY.md").read_text(encoding="utf-8")
    missing = []
    for cell in re.findall(r"\| ([^|]*tests?[^|]*)\|\s*$", text, flags=re.M):
        current = None
        for ref in re.findall(r"`([^`]+)`", cell):
            path, _, name = ref.partition("::")
            if path:
                path = path if path.startswith("tests/") else f"tests/{path}"
                if not path.endswith(".py"):
                    continue
                current = root / path
                if not current.exists():
                    missing.append(ref)
                    continue
            if name and current is not None:
                function = name.split("[")[0]
                if f"def {function}(" not in current.read_text(encoding="utf-8"):
                    missing.append(f"{current.name}::{function}")
    assert missing == []
