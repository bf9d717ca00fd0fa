"""A keyed bijection of ``[0, n)`` with O(1) memory and O(1) access to any position.

This is the shuffle of the planning core: the epoch's global order is
``order[p] = permutation(p)``.  It is a balanced Feistel network over the smallest
power-of-four domain that holds ``n``, made exact on ``[0, n)`` by cycle walking:
a value that lands outside ``[0, n)`` is encrypted again until it lands inside.
Because the network is a bijection of its domain, cycle walking is a bijection of
``[0, n)``.  The domain is less than ``4 * n``, so a position takes fewer than four
rounds of walking on average.

Everything here is pure numpy: no torch, no I/O, and no array of size ``n``.
"""

from __future__ import annotations

import hashlib

import numpy as np
import numpy.typing as npt

__all__ = ["FeistelPermutation", "as_int64", "derive_keys", "mix64", "sample_seeds"]

U64 = npt.NDArray[np.uint64]

_ROUNDS = 6
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)


def mix64(x: U64) -> U64:
    """SplitMix64's finaliser: a fast bijective mix of 64-bit words (wraps mod 2**64)."""
    x = x ^ (x >> _S30)
    x = x * _M1
    x = x ^ (x >> _S27)
    x = x * _M2
    return x ^ (x >> _S31)


def derive_keys(domain: str, seed: int, epoch: int, count: int) -> list[int]:
    """``count`` 64-bit keys drawn from (domain, seed, epoch) by BLAKE2b.

    Keys for different domains ("shuffle", "sample", ...) are unrelated, which keeps
    the shuffle stream separate from the per-sample random streams.
    """
    digest = hashlib.blake2b(
        f"evenly/{domain}/{seed}/{epoch}".encode(), digest_size=8 * count
    ).digest()
    return [int.from_bytes(digest[8 * i : 8 * i + 8], "little") for i in range(count)]


class FeistelPermutation:
    """A pseudo-random permutation of ``[0, n)`` keyed by ``(seed, epoch)``.

    >>> perm = FeistelPermutation(10, seed=0, epoch=0)
    >>> sorted(perm(np.arange(10)).tolist()) == list(range(10))
    True
    """

    def __init__(self, n: int, *, seed: int, epoch: int) -> None:
        if n < 0:
            raise ValueError(f"the permutation size must be >= 0, got {n}")
        if n >= 2**62:
            raise ValueError(f"the permutation size must be < 2**62, got {n}")
        self.n = n
        bits = max(2, (n - 1).bit_length()) if n > 1 else 2
        self._half = (bits + 1) // 2
        self._mask = np.uint64((1 << self._half) - 1)
        self._shift = np.uint64(self._half)
        self._keys = [np.uint64(k) for k in derive_keys("shuffle", seed, epoch, _ROUNDS)]

    def _encrypt(self, x: U64) -> U64:
        left = x >> self._shift
        right = x & self._mask
        for key in self._keys:
            left, right = right, left ^ (mix64(right ^ key) & self._mask)
        return (left << self._shift) | right

    def __call__(self, positions: npt.ArrayLike) -> npt.NDArray[np.int64]:
        """Map positions in ``[0, n)`` to sample indices in ``[0, n)`` (any shape: a
        scalar gives a 0-d array, a 2-D array a 2-D array)."""
        pos = as_int64(positions)
        if pos.size and (int(pos.min()) < 0 or int(pos.max()) >= self.n):
            bad = int(pos.min()) if int(pos.min()) < 0 else int(pos.max())
            raise IndexError(f"positions must lie in [0, {self.n}), got {bad}")
        if self.n <= 1:
            return pos.copy()
        flat = pos.reshape(-1).astype(np.uint64)
        out = self._encrypt(flat)
        bound = np.uint64(self.n)
        outside = np.flatnonzero(out >= bound)
        while outside.size:
            out[outside] = self._encrypt(out[outside])
            outside = outside[out[outside] >= bound]
        return out.astype(np.int64).reshape(pos.shape)


def as_int64(values: npt.ArrayLike) -> npt.NDArray[np.int64]:
    """Integer positions as int64 (any shape); a clear error for floats or bools."""
    arr = np.asarray(values)
    if arr.dtype == np.bool_ or not (arr.size == 0 or np.issubdtype(arr.dtype, np.integer)):
        raise TypeError(f"positions must be integers, got an array of {arr.dtype}")
    if arr.dtype == np.uint64 and arr.size and int(arr.max()) >= 2**63:
        raise IndexError(f"position {int(arr.max())} is out of range")
    return arr.astype(np.int64, copy=False)


def sample_seeds(seed: int, epoch: int, positions: npt.ArrayLike) -> U64:
    """Per-sample 64-bit seeds for (seed, epoch, global position in the epoch's order).

    They depend on the position only, never on rank or worker, and share no key with
    the shuffle.
    """
    (key,) = derive_keys("sample", seed, epoch, 1)
    pos = as_int64(positions)
    flat = pos.reshape(-1).astype(np.uint64)
    return mix64(mix64(flat * _GOLDEN) ^ np.uint64(key)).reshape(pos.shape)
