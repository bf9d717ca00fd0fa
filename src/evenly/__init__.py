"""evenly: PyTorch iterable datasets that are correct under DataLoader workers and DDP.

>>> import evenly
>>> ds = evenly.Dataset(list(range(100)), shuffle=True, seed=0)
>>> loader = evenly.DataLoader(ds, batch_size=10, num_workers=0)
>>> sum(len(batch) for batch in loader)
100

``import evenly`` is light: torch loads on first use of ``evenly.Dataset`` (or any
name that needs it), the file formats (pyarrow, fsspec) on first use of
``evenly.from_parquet`` ..., the audit's report dependencies when an audit runs.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from evenly import (
    audit,
    interop,  # noqa: F401  (importing it registers the framework hooks)
)
from evenly.core.packing.settings import Packing
from evenly.errors import EvenlyWarning, PlanMismatchError, StateError, warn_deprecated
from evenly.mixture import Mix

if TYPE_CHECKING:
    from evenly.dataset import Dataset
    from evenly.loader.loader import DataLoader
    from evenly.loader.sampler import BatchSampler
    from evenly.loader.stats import EpochStats, LoaderStats
    from evenly.runtime.seeds import is_padding, sample_seed
    from evenly.sources import (
        from_arrow,
        from_jsonl,
        from_megatron,
        from_parquet,
        from_webdataset,
        tokenizer,
        write,
    )

__all__ = [
    "BatchSampler",
    "DataLoader",
    "Dataset",
    "EpochStats",
    "EvenlyWarning",
    "LoaderStats",
    "Mix",
    "Packing",
    "PlanMismatchError",
    "StateError",
    "__version__",
    "audit",
    "from_arrow",
    "from_jsonl",
    "from_megatron",
    "from_parquet",
    "from_webdataset",
    "is_padding",
    "sample_seed",
    "tokenizer",
    "write",
]

__version__ = "0.2.0.dev0"

#: Public names loaded on first use (module, attribute): torch, pyarrow and fsspec load
#: only when something that needs them is used.
_LAZY = {
    "BatchSampler": ("evenly.loader.sampler", "BatchSampler"),
    "DataLoader": ("evenly.loader.loader", "DataLoader"),
    "Dataset": ("evenly.dataset", "Dataset"),
    "EpochStats": ("evenly.loader.stats", "EpochStats"),
    "LoaderStats": ("evenly.loader.stats", "LoaderStats"),
    "sample_seed": ("evenly.runtime.seeds", "sample_seed"),
    "is_padding": ("evenly.runtime.seeds", "is_padding"),
    "from_arrow": ("evenly.sources", "from_arrow"),
    "from_jsonl": ("evenly.sources", "from_jsonl"),
    "from_megatron": ("evenly.sources", "from_megatron"),
    "from_parquet": ("evenly.sources", "from_parquet"),
    "from_webdataset": ("evenly.sources", "from_webdataset"),
    "tokenizer": ("evenly.sources", "tokenizer"),
    "write": ("evenly.sources", "write"),
}

#: Names that moved (old ``evenly.<name>`` -> new home): they still resolve, with a
#: ``DeprecationWarning``, until evenly 0.3.
_MOVED = {
    "EpochPlan": "evenly.core",
    "FeistelPermutation": "evenly.core",
    "Source": "evenly.core",
    "Topology": "evenly.core",
    "detect_topology": "evenly.runtime.detect",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module, attribute = _LAZY[name]
        value = getattr(importlib.import_module(module), attribute)
        globals()[name] = value
        return value
    if name in _MOVED:  # never cached: every use warns
        warn_deprecated(f"evenly.{name}", f"{_MOVED[name]}.{name}")
        return getattr(importlib.import_module(_MOVED[name]), name)
    raise AttributeError(f"module 'evenly' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
