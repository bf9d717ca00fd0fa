"""The pure planning core: numpy only, no torch, no I/O (``tests/test_import.py`` imports
every module of it with ``torch`` blocked).  Permutations, orders, epoch and stream plans,
the topology value, pass states and the pass tracker, source protocols, mixtures.

Its public names are the planning internals a user may want to look at or build on:

>>> from evenly.core import EpochPlan, FeistelPermutation
>>> plan = EpochPlan(num_samples=10, world_size=2, batch_size=3,
...                  order=FeistelPermutation(10, seed=0, epoch=0))
>>> plan.rank_batches(0), plan.rank_batches(1)
(2, 2)
"""

from evenly.core.permutation import FeistelPermutation
from evenly.core.plan import EpochPlan
from evenly.core.source import Source
from evenly.core.topology import Topology

__all__ = ["EpochPlan", "FeistelPermutation", "Source", "Topology"]
