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
