"""The block shuffle: a shard-aware bijection of ``[0, N)`` for sources read by shard.

A global shuffle sends consecutive positions to random shards, which is what a shuffle
should do, but costs one shard read per sample when shards are remote files.  The block
shuffle trades a little randomness for locality:

1. per ``(seed, epoch)``, permute the order of the shards;
2. cut the permuted list into *windows* of ``window`` consecutive shards;
3. inside each window, shuffle uniformly over all the samples of its shards.

Positions ``[0, N)`` walk the windows in order, so any run of consecutive positions
touches the shards of at most two adjacent windows, and a worker that reads a stretch
of the order needs at most ``2 * window`` shards at a time (``window`` once the stretch
sits inside one window).  Every sample still appears exactly once per epoch: the map is
a bijection for any shard sizes, including empty shards.

Pure numpy: no torch, no I/O, and memory ``O(num_shards)``, never ``O(N)``.

>>> perm = BlockPermutation([3, 0, 4, 2], window=2, seed=0, epoch=0)
>>> sorted(perm(range(9)).tolist())
[0, 1, 2, 3, 4, 5, 6, 7, 8]
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from evenly.core.permutation import FeistelPermutation, derive_keys

__all__ = ["BlockPermutation"]

I64 = npt.NDArray[np.int64]


class BlockPermutation:
    """Position -> sample index for the block shuffle of shards of the given sizes.

    Shard ``k`` holds the global indices ``[sum(sizes[:k]), sum(sizes[:k+1]))``.

    >>> perm = BlockPermutation([2, 2, 2, 2], window=2, seed=3, epoch=1)
    >>> first = perm(range(4)).tolist()          # the first window: two whole shards
    >>> sorted({index // 2 for index in first}) == sorted(perm.window_shards(0))
    True

    Args:
        shard_sizes: samples per shard, in index order (zeros allowed).
        window: shards per shuffle window (``K``); ``window >= num_shards`` is a global
            shuffle of the shards' samples.
        seed, epoch: the shuffle key; a new epoch gives a new shard order and new windows.
    """

    def __init__(self, shard_sizes: Sequence[int], window: int, *, seed: int, epoch: int) -> None:
        sizes = np.asarray(list(shard_sizes), dtype=np.int64).reshape(-1)
        if sizes.size and int(sizes.min()) < 0:
            bad = int(np.flatnonzero(sizes < 0)[0])
            raise ValueError(f"shard sizes must be >= 0, got {int(sizes[bad])} for shard {bad}")
        if isinstance(window, bool) or not isinstance(window, int | np.integer) or window < 1:
            raise ValueError(
                f"the block shuffle window must be an integer >= 1 (shards per window), "
                f"got {window!r}"
            )
        self.num_shards = int(sizes.size)
        self.window = int(window)
        self.seed = int(seed)
        self.epoch = int(epoch)
        #: first global index of each shard, in index order (length num_shards + 1)
        self._index_start = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.n = int(self._index_start[-1])
        shard_key, self._window_key = derive_keys("block", self.seed, self.epoch, 2)
        #: shard at each slot of the epoch's shard order
        self._order = FeistelPermutation(self.num_shards, seed=shard_key, epoch=0)(
            np.arange(self.num_shards, dtype=np.int64)
        )
        #: first position of each slot (length num_shards + 1)
        self._slot_start = np.concatenate([[0], np.cumsum(sizes[self._order])]).astype(np.int64)
        num_windows = -(-self.num_shards // self.window)
        bounds = np.minimum(
            np.arange(num_windows + 1, dtype=np.int64) * self.window, self.num_shards
        )
        #: first position of each window (length num_windows + 1)
        self._window_start = self._slot_start[bounds]
        self.num_windows = num_windows

    def window_shards(self, window: int) -> list[int]:
        """The shards (by index order) of window ``window`` in this epoch."""
        if not 0 <= window < self.num_windows:
            raise IndexError(f"window must lie in [0, {self.num_windows}), got {window}")
        lo = window * self.window
        return [int(s) for s in self._order[lo : lo + self.window]]

    def shard_of(self, indices: npt.ArrayLike) -> I64:
        """The shard holding each global sample index."""
        idx = np.asarray(indices, dtype=np.int64)
        return (np.searchsorted(self._index_start, idx, side="right") - 1).astype(np.int64)

    def _in_window(self, window: int) -> FeistelPermutation:
        size = int(self._window_start[window + 1] - self._window_start[window])
        return FeistelPermutation(size, seed=self._window_key, epoch=window)

    def __call__(self, positions: npt.ArrayLike) -> I64:
        """Map positions in ``[0, N)`` to global sample indices."""
        pos = np.asarray(positions, dtype=np.int64)
        if pos.size and (int(pos.min()) < 0 or int(pos.max()) >= self.n):
            raise IndexError(f"positions must lie in [0, {self.n})")
        flat = pos.reshape(-1)
        # The last window starting at or before p holds p (empty windows start where the
        # next one does, so side="right" skips them).
        windows = np.searchsorted(self._window_start, flat, side="right") - 1
        shuffled = np.empty_like(flat)
        for w in np.unique(windows).tolist():
            sel = windows == w
            base = self._window_start[w]
            shuffled[sel] = base + self._in_window(w)(flat[sel] - base)
        slots = np.searchsorted(self._slot_start, shuffled, side="right") - 1
        offsets = shuffled - self._slot_start[slots]
        out = self._index_start[self._order[slots]] + offsets
        return out.astype(np.int64).reshape(pos.shape)
