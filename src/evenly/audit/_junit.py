"""JUnit XML of audit results, for CI (``evenly audit ... --junit FILE``).

One ``<testsuite>`` per audited factory, one ``<testcase>`` per finding: a FAIL finding
is a ``<failure>``, a WARN one passes with its detail in ``<system-out>`` (CI shows it,
the build stays green: the audit's exit status is 1 only on a FAIL).  An audit on more
than one simulated node names its layout in the suite's ``<property name="nodes">``.

>>> from evenly.audit._types import Finding
>>> xml = junit_xml([("demo:f", [Finding("missing", "Missing", "FAIL", 3, "3 missing")])])
>>> '<failure message="3 missing"' in xml
True
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ._types import Finding

if TYPE_CHECKING:
    from ._result import AuditResult

__all__ = ["junit_xml", "write_junit"]


def junit_xml(
    suites: Sequence[tuple[str, Sequence[Finding]]],
    properties: Sequence[Mapping[str, str]] = (),
) -> str:
    """The JUnit XML document of ``(factory, findings)`` pairs (``properties``: per
    suite, in the same order, its ``<properties>``; none where missing or empty)."""
    root = ET.Element("testsuites", name="evenly audit")
    total = failed = 0
    for i, (factory, findings) in enumerate(suites):
        fails = sum(f.status == "FAIL" for f in findings)
        suite = ET.SubElement(
            root,
            "testsuite",
            name=factory,
            tests=str(len(findings)),
            failures=str(fails),
            errors="0",
            skipped="0",
        )
        if i < len(properties) and properties[i]:
            props = ET.SubElement(suite, "properties")
            for name, value in properties[i].items():
                ET.SubElement(props, "property", name=name, value=value)
        for f in findings:
            case = ET.SubElement(suite, "testcase", classname=factory, name=f.name)
            if f.status == "FAIL":
                failure = ET.SubElement(case, "failure", message=f.detail, type="FAIL")
                failure.text = f"{f.title}: {f.detail}"
            elif f.status == "WARN":
                ET.SubElement(case, "system-out").text = f"WARN {f.title}: {f.detail}"
        total += len(findings)
        failed += fails
    root.set("tests", str(total))
    root.set("failures", str(failed))
    return ET.tostring(root, encoding="unicode", xml_declaration=True)


def write_junit(results: Sequence[AuditResult], path: str | Path) -> Path:
    """Write the JUnit XML of ``results`` to ``path``; return it."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    props = [{"nodes": r.records.layout()} if r.settings.nodes > 1 else {} for r in results]
    out.write_text(junit_xml([(r.factory, r.findings) for r in results], props), encoding="utf-8")
    return out
