"""Lightning over evenly in real 2-rank gloo DDP runs.

Lightning saves ``loader.state_dict()`` in its mid-epoch checkpoints, restores it on
``fit(ckpt_path=...)``, restores its own batch counter and stops the epoch at
``num_training_batches``: the resumed run must deliver exactly the samples the interrupted
epoch had not delivered.  With a plain torch DataLoader over ``evenly.Dataset`` (Lightning
calls ``set_epoch`` on samplers only) the epochs must still advance.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.distributed import in_fresh_process, run_ranks
from tests.interop_scripts import lightning_ranks
from tests.interop_scripts.expect import (
    Epoch,
    assert_equal_batches,
    assert_exactly_once,
    assert_order_changes,
    join,
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("lightning") is None, reason="needs lightning (test extra)"
    ),
]

WORLD = 2
NS = (1000, 1001)
STEPS = 20
QUIET = {"PYTHONWARNINGS": "ignore"}


def check_resume(before: Epoch, after: list[Epoch], n: int, world: int, what: str) -> None:
    """``before[rank]``: the batches of epoch 0 before the checkpoint; ``after[rank][e]``:
    epoch e's batches in the resumed run."""
    rest, epoch1 = ([a[e] for a in after] for e in range(2))
    assert [len(b) for b in before] == [STEPS] * world, f"{what}: the first run did not stop"
    epoch0 = join(before, rest)
    assert_equal_batches(rest, f"{what}, rest of epoch 0")
    assert_exactly_once(epoch0, n, world, f"{what}, epoch 0 (both runs)")
    assert_exactly_once(epoch1, n, world, f"{what}, epoch 1")
    assert_equal_batches(epoch1, f"{what}, epoch 1")
    assert_order_changes(epoch0, epoch1, what)


def test_lightning_ddp_mid_epoch_checkpoint_resumes_exactly_in_a_fresh_run(
    tmp_path: Path,
) -> None:
    root = str(tmp_path)
    first = run_ranks(lightning_ranks.fit_until_checkpoint, WORLD, NS, root, STEPS, env=QUIET)
    second = run_ranks(lightning_ranks.resume_fit, WORLD, NS, root, env=QUIET)
    for n in NS:
        check_resume([r[n] for r in first], [r[n] for r in second], n, WORLD, f"ddp, N={n}")


def test_lightning_single_device_mid_epoch_checkpoint_resumes_exactly(tmp_path: Path) -> None:
    out = in_fresh_process(lightning_ranks.fit_resume_single, str(tmp_path), NS, STEPS)
    for n in NS:
        check_resume([out["before"][n]], [out["after"][n]], n, 1, f"1 device, N={n}")


def test_lightning_plain_dataloader_over_evenly_dataset_advances_epochs(tmp_path: Path) -> None:
    results = run_ranks(lightning_ranks.fit, WORLD, NS, str(tmp_path), True, env=QUIET)
    for n in NS:
        epochs = [[r[n][e] for r in results] for e in range(2)]
        for e, epoch in enumerate(epochs):
            assert_exactly_once(epoch, n, WORLD, f"plain DataLoader, N={n}, epoch {e}")
            assert_equal_batches(epoch, f"plain DataLoader, N={n}, epoch {e}")
        assert_order_changes(epochs[0], epochs[1], f"plain DataLoader, N={n}")
