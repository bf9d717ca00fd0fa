"""Griffe extension for the docs site (mkdocs.yml): evenly's docstrings as Markdown.

evenly's docstrings carry their examples as bare doctest blocks (``>>>`` lines, run by
pytest's ``--doctest-modules``). Griffe's Google parser treats ``>>>`` as code only in
an ``Examples:`` section; anywhere else Markdown reads it as nested block quotes. This
extension fences every bare doctest block as ``pycon`` (dropping ``# doctest:``
directives) and turns Sphinx roles (``:func:`x```) into inline code when griffe loads a
docstring, so the sources stay as they are. A docstring with an ``Examples:`` section
is left to griffe.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_FENCE = re.compile(r"^\s*(```|~~~)")
_DIRECTIVE = re.compile(r"\s*#\s*doctest:.*$")
_EXAMPLES = re.compile(r"^\s*Examples?:\s*$", re.MULTILINE)
_ROLE = re.compile(r":(?:py:)?(?:func|meth|class|attr|mod|data|exc|obj):`~?([^`]+)`")


def fence_doctests(text: str) -> str:
    """Wrap each bare doctest block of ``text`` (``>>>`` up to a blank line) in a fence."""
    lines = text.splitlines()
    out: list[str] = []
    in_fence = False
    i = 0
    while i < len(lines):
        line = lines[i]
        if _FENCE.match(line):
            in_fence = not in_fence
        if in_fence or not line.lstrip().startswith(">>>"):
            out.append(line)
            i += 1
            continue
        indent = line[: len(line) - len(line.lstrip())]
        if out and out[-1].strip():
            out.append("")
        out.append(f"{indent}```pycon")
        while i < len(lines) and lines[i].strip():
            out.append(_DIRECTIVE.sub("", lines[i]))
            i += 1
        out.append(f"{indent}```")
    return "\n".join(out)


def plain_roles(text: str) -> str:
    """Turn Sphinx cross-reference roles into inline code (the names are not rendered)."""
    return _ROLE.sub(r"`\1`", text)


class MarkdownDocstrings(griffe.Extension):
    """Fence bare doctest blocks and drop Sphinx roles in every docstring griffe loads."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        docstring = obj.docstring
        if docstring is None:
            return
        value = docstring.value
        if ">>>" in value and not _EXAMPLES.search(value):
            value = fence_doctests(value)
        if "`" in value:
            value = plain_roles(value)
        docstring.value = value
