"""evenly: PyTorch iterable datasets that are correct under DataLoader workers and DDP.

>>> import evenly
>>> ds = evenly.Dataset(list(range(100)), shuffle=True, seed=0)
>>> loader = evenly.DataLoader(ds, batch_size=10, num_workers=0)
>>> sum(len(batch) for batch in loader)
100
"""

from ._dataset import Dataset, EvenlyWarning, Source
from ._loader import DataLoader
from ._permutation import FeistelPermutation
from ._plan import EpochPlan
from ._state import StateError
from ._topology import Topology, detect_topology
from .audit import audit
from .sources import from_jsonl, from_parquet, from_webdataset, write

__all__ = [
    "DataLoader",
    "Dataset",
    "EpochPlan",
    "EvenlyWarning",
    "FeistelPermutation",
    "Source",
    "StateError",
    "Topology",
    "__version__",
    "audit",
    "detect_topology",
    "from_jsonl",
    "from_parquet",
    "from_webdataset",
    "write",
]

__version__ = "0.1.0"
