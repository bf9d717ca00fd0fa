"""A loader restarted again and again (a few batches, ``break``, iterate again, as an
evaluation every N steps does) keeps a bounded number of files open, in the main process
and in its workers: the decoded-row cache's mapped row groups hold no descriptor."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Literal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import evenly

ROWS, GROUP = 2000, 10  # 200 row groups: nearly every sample read maps a new one


def open_fds() -> int:
    """Descriptors open in this process and its children (the loader's workers)."""
    me = os.getpid()
    children = Path(f"/proc/{me}/task/{me}/children").read_text().split()
    return sum(len(os.listdir(f"/proc/{pid}/fd")) for pid in [me, *map(int, children)])


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc")
@pytest.mark.parametrize("worker_type", ["process", "thread"])
def test_break_and_restart_cycles_keep_open_files_bounded(
    worker_type: Literal["process", "thread"], tmp_path: Path
) -> None:
    """20 cycles of 3 batches and a break over a Parquet source with the decoded-row
    cache: the descriptors open after 20 cycles are those after 2 (a small margin for
    torch's shared-memory hand-offs), where each mapped row group used to keep one."""
    for shard in range(4):
        ids = np.arange(shard * ROWS // 4, (shard + 1) * ROWS // 4, dtype=np.int64)
        pq.write_table(
            pa.table({"id": ids}), tmp_path / f"part-{shard}.parquet", row_group_size=GROUP
        )
    source = evenly.from_parquet(str(tmp_path), cache_dir=str(tmp_path / "cache"))
    loader = evenly.DataLoader(
        evenly.Dataset(source, shuffle=True),
        batch_size=4,
        num_workers=2,
        worker_type=worker_type,
    )
    counts = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", evenly.EvenlyWarning)
        for _ in range(20):
            for k, _batch in enumerate(loader):
                if k == 2:
                    break
            counts.append(open_fds())
    assert counts[-1] <= counts[1] + 8, counts
