"""``evenly audit``: does a dataset deliver each sample exactly once, shuffled, in equal
batches, with independent random streams, under real DataLoader workers and DDP ranks?

>>> import evenly
>>> result = evenly.audit.run("examples.talk_attempts:evenly_dataset",  # doctest: +SKIP
...                           num_workers=2, world_size=2, epochs=2, batch_size=10)
>>> result.ok                                                           # doctest: +SKIP
True
>>> print(result.to_json())                                             # doctest: +SKIP

From a shell: ``evenly audit examples.talk_attempts:naive --workers 2 --world-size 2``.

Importing this package is cheap (``import evenly`` does it): each name below is loaded
from its module on first use, and the modules that run ranks (torch.distributed), print
tables (rich) or draw the report (matplotlib, ``pip install 'evenly[report]'``) only
when an audit runs, prints or draws.

Until evenly 0.3 the module can still be called as the function it replaced,
``evenly.audit(factory, ...)`` (and ``evenly.audit.audit`` still names ``run``), with a
``DeprecationWarning``.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

from evenly.errors import warn_deprecated

if TYPE_CHECKING:
    from ._api import audit_many, build_records, run
    from ._findings import all_findings
    from ._result import AuditResult
    from ._trace import default_id
    from ._types import AuditError, Finding, LoaderFactory, RankEpoch, Records, Status

__all__ = [
    "AuditError",
    "AuditResult",
    "Finding",
    "LoaderFactory",
    "RankEpoch",
    "Records",
    "Status",
    "all_findings",
    "audit_many",
    "build_records",
    "default_id",
    "run",
]

#: Where each public name lives.
_HOME = {
    "AuditError": "._types",
    "AuditResult": "._result",
    "Finding": "._types",
    "LoaderFactory": "._types",
    "RankEpoch": "._types",
    "Records": "._types",
    "Status": "._types",
    "all_findings": "._findings",
    "audit_many": "._api",
    "build_records": "._api",
    "default_id": "._trace",
    "run": "._api",
}


def __getattr__(name: str) -> Any:
    if name == "audit":  # the function's old name; never cached: every use warns
        warn_deprecated("evenly.audit.audit", "evenly.audit.run")
        return importlib.import_module("._api", __name__).run
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home, __name__), name)
    globals()[name] = value  # resolved once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _CallableModule(types.ModuleType):
    """This module, callable as the function ``evenly.audit`` it replaced (deprecated)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        warn_deprecated("calling evenly.audit(...)", "evenly.audit.run(...)")
        return importlib.import_module("._api", __name__).run(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
