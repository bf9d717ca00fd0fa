"""Terminal output: a rich table of the findings (and the same as plain JSON elsewhere).

>>> from evenly.audit._types import Finding
>>> table = findings_table("demo", [Finding("duplicates", "Duplicates", "PASS", 0, "none")])
>>> table.row_count, [c.header for c in table.columns]
(1, ['finding', 'status', 'value', 'detail'])

For an audit of an ``evenly.Mix``, ``mix_table`` adds the samples per source and epoch.
"""

from __future__ import annotations

from collections.abc import Sequence

from rich.table import Table
from rich.text import Text

from ._result import AuditResult
from ._types import Finding

__all__ = ["findings_table", "mix_table", "result_table"]

_STYLE = {"PASS": "bold green", "WARN": "bold yellow", "FAIL": "bold red"}


def findings_table(title: str, findings: Sequence[Finding], caption: str = "") -> Table:
    """A table with one row per finding: what, verdict, number, explanation."""
    table = Table(title=title, caption=caption or None, show_lines=False, expand=False)
    table.add_column("finding", no_wrap=True)
    table.add_column("status", no_wrap=True)
    table.add_column("value", justify="right", no_wrap=True)
    table.add_column("detail", overflow="fold")
    for f in findings:
        table.add_row(f.title, Text(f.status, style=_STYLE[f.status]), f"{f.value:g}", f.detail)
    return table


def result_table(result: AuditResult) -> Table:
    """The findings of one audit, titled with the factory and the topology (and the node
    layout in the caption, on more than one node)."""
    s = result.settings
    ranks = f"{s.world_size} rank(s)"
    if s.nodes > 1:
        ranks = f"{s.nodes} nodes x {s.world_size // s.nodes} ranks"
    title = (
        f"evenly audit {result.factory}: {ranks} x {s.num_workers} worker(s) x {s.epochs} "
        f"epoch(s), batch size {s.batch_size}"
    )
    verdict = "OK" if result.ok else "FAIL"
    caption = f"{verdict}: {len(result.records)} samples delivered"
    if s.nodes > 1:
        caption += f"; nodes: {result.records.layout()}"
    return findings_table(title, result.findings, caption)


def mix_table(result: AuditResult) -> Table | None:
    """For an audit of an ``evenly.Mix``: one row per epoch, one column per source, each
    cell ``delivered / expected`` samples (yellow where off by the epoch's padding or
    drop_last, red beyond); else ``None``."""
    from ._coverage import cell_status

    mix = result.mix_dict()
    if mix is None:
        return None
    table = Table(title="samples per source and epoch (delivered / mix.counts)", expand=False)
    table.add_column("epoch", justify="right", no_wrap=True)
    for name in mix["sources"]:
        table.add_column(str(name), justify="right", no_wrap=True)
    for row in mix["per_epoch"]:
        cells = [
            Text(
                f"{row['delivered'][name]} / {row['expected'][name]}",
                style={"PASS": "", "WARN": "yellow", "FAIL": "bold red"}[cell_status(row, name)],
            )
            for name in mix["sources"]
        ]
        table.add_row(str(row["epoch"]), *cells)
    return table
