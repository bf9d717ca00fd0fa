"""``AuditResult``: what an audit recorded and found, as JSON or an HTML report.

>>> from evenly.audit._types import Finding, Records, Settings
>>> import numpy as np
>>> empty = np.zeros(0, dtype=np.int64)
>>> rec = Records(ids=empty, rank=empty, worker=empty, epoch=empty, batch=empty,
...               pos=empty, draws=np.zeros((0, 3)), per_rank=[], world_size=1,
...               num_workers=0, epochs=1, batch_size=2, expected=0)
>>> result = AuditResult("demo:factory", Settings(0, 1, 1, 2), rec,
...                      [Finding("missing", "Missing samples", "PASS", 0.0, "none")])
>>> result.ok, result.finding("missing").detail
(True, 'none')
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ._types import Finding, Records, Settings, passed

if TYPE_CHECKING:
    from ._resume import ResumeReport

__all__ = ["AuditResult"]


@dataclass
class AuditResult:
    """What an audit recorded and found.

    ``findings`` in report order; ``ok`` is False when any finding is FAIL.
    """

    factory: str
    settings: Settings
    records: Records
    findings: list[Finding]
    #: what ``resume=True`` ran (None without it)
    resume: ResumeReport | None = None

    @property
    def ok(self) -> bool:
        return passed(self.findings)

    def finding(self, name: str) -> Finding:
        """The finding called ``name`` (``duplicates``, ``missing``, ``rank_balance``...)."""
        for f in self.findings:
            if f.name == name:
                return f
        raise KeyError(f"no finding {name!r}; have {[f.name for f in self.findings]}")

    def to_dict(self) -> dict[str, Any]:
        s = self.settings
        rec = self.records
        return {
            "factory": self.factory,
            "ok": self.ok,
            "num_workers": s.num_workers,
            "world_size": s.world_size,
            "epochs": s.epochs,
            "batch_size": s.batch_size,
            "nodes": s.nodes,
            "node_layout": rec.layout(),
            "ranks_seen": rec.seen,
            "samples_delivered": len(rec),
            "expected_per_epoch": rec.expected,
            "expected_source": rec.expected_source,
            "findings": [f.to_dict() for f in self.findings],
            "per_rank": [
                {
                    "rank": r.rank,
                    "epoch": r.epoch,
                    "samples": r.samples,
                    "batches": r.batches,
                    "len": r.reported_len,
                    "len_loader": r.reported_batches,
                }
                for r in rec.per_rank
            ],
            "warnings": rec.warnings,
            "mix": self.mix_dict(),
            "resume": None if self.resume is None else self.resume.to_dict(),
        }

    def mix_dict(self) -> dict[str, Any] | None:
        """For an ``evenly.Dataset`` over an ``evenly.Mix``: its sources, lengths and
        counts per epoch, and per audited epoch each source's samples delivered,
        expected and stream offset; else ``None``."""
        rec = self.records
        if rec.mix is None:
            return None
        # Deferred: only an audit of a Mix needs it.
        from ._coverage import per_epoch

        return {**rec.mix.to_dict(), "per_epoch": per_epoch(rec)}

    def to_json(self, indent: int | None = 2) -> str:
        """The result as JSON (findings, settings, per-rank counts, warnings; the node
        layout, and per rank what it saw of it under ``"ranks_seen"``: ``rank``, ``node``
        (``GROUP_RANK``), ``local_rank``, ``local_world_size``, ``host``; for a Mix, the
        samples per source per epoch under ``"mix"``)."""
        return json.dumps(self.to_dict(), indent=indent)

    def write_report(self, directory: str | Path) -> Path:
        """Write ``index.html`` and its PNG plots into ``directory``; return the page.

        Needs matplotlib (``pip install 'evenly[report]'``); without it, raises
        ``AuditError`` saying so and writes nothing.
        """
        # Deferred: the report module is only needed here (it imports matplotlib lazily).
        from ._report import write_report

        return write_report(Path(directory), self.factory, self.records, self.findings, self.resume)
