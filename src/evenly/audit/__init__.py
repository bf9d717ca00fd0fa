"""``evenly audit``: does a dataset deliver each sample exactly once, shuffled, in equal
batches, with independent random streams, under real DataLoader workers and DDP ranks?

>>> from evenly.audit import audit
>>> result = audit("examples.talk_attempts:evenly_dataset", num_workers=2,  # doctest: +SKIP
...                world_size=2, epochs=2, batch_size=10)
>>> result.ok                                                               # doctest: +SKIP
True
>>> print(result.to_json())                                                 # doctest: +SKIP

From a shell: ``evenly audit examples.talk_attempts:naive --workers 2 --world-size 2``.
"""

from ._api import AuditResult, audit, audit_many, build_records
from ._collect import AuditError
from ._findings import all_findings
from ._trace import default_id
from ._types import Finding, RankEpoch, Records, Status

__all__ = [
    "AuditError",
    "AuditResult",
    "Finding",
    "RankEpoch",
    "Records",
    "Status",
    "all_findings",
    "audit",
    "audit_many",
    "build_records",
    "default_id",
]
