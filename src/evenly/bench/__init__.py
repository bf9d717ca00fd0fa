"""``evenly bench``: run a user's dataset under several loader configurations (0..k
workers, and any other mode the loader offers), print a table of what each gives, and
advise (more workers, no workers, Arrow instead of Parquet/JSONL, block shuffle,
``seed_generators``), with a plot in ``--report``.

    evenly bench mypkg.data:make_dataset --batches 100 --batch-size 64 --workers 0,2,4
"""

from __future__ import annotations

from evenly.bench._advice import Advice, Facts, Row, advise

__all__ = ["Advice", "Facts", "Row", "advise"]
