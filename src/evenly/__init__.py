"""evenly: PyTorch iterable datasets that are correct under DataLoader workers and DDP.

>>> import evenly
>>> ds = evenly.Dataset(list(range(100)), shuffle=True, seed=0)
>>> loader = evenly.DataLoader(ds, batch_size=10, num_workers=0)
>>> sum(len(batch) for batch in loader)
100

``import evenly`` is light: the file formats (pyarrow, fsspec) load on first use of
``evenly.from_parquet`` ..., the audit's report dependencies when an audit runs.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._agreement import PlanMismatchError
from ._dataset import Dataset, EvenlyWarning, Source
from ._loader import DataLoader
from ._mixsource import Mix
from ._pass import PassSpec
from ._permutation import FeistelPermutation
from ._plan import EpochPlan
from ._rng import sample_seed
from ._sampler import BatchSampler
from ._state import StateError
from ._topology import Topology, detect_topology
from .audit import audit  # a light package: its heavy parts load when an audit runs

if TYPE_CHECKING:
    from .sources import from_arrow, from_jsonl, from_parquet, from_webdataset, write

__all__ = [
    "BatchSampler",
    "DataLoader",
    "Dataset",
    "EpochPlan",
    "EvenlyWarning",
    "FeistelPermutation",
    "Mix",
    "PassSpec",
    "PlanMismatchError",
    "Source",
    "StateError",
    "Topology",
    "__version__",
    "audit",
    "detect_topology",
    "from_arrow",
    "from_jsonl",
    "from_parquet",
    "from_webdataset",
    "sample_seed",
    "write",
]

__version__ = "0.2.0.dev0"

#: Public names loaded on first use (module, attribute).
_LAZY = {
    "from_arrow": ("evenly.sources", "from_arrow"),
    "from_jsonl": ("evenly.sources", "from_jsonl"),
    "from_parquet": ("evenly.sources", "from_parquet"),
    "from_webdataset": ("evenly.sources", "from_webdataset"),
    "write": ("evenly.sources", "write"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module, attribute = _LAZY[name]
        value = getattr(importlib.import_module(module), attribute)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'evenly' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
