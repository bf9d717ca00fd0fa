"""Keyed bijections of ``[0, n)`` with O(1) memory and O(1) access to any position.

This is the shuffle of the planning core: the epoch's global order is
``order[p] = permutation(p)``.  There is one Feistel network (:func:`feistel_walk`): six
rounds over a domain of ``2 ** (lbits + rbits)`` values, made exact on ``[0, n)`` by cycle
walking: a value that lands outside ``[0, n)`` is encrypted again until it lands inside.
Because the network is a bijection of its domain, cycle walking is a bijection of
``[0, n)``.

Two key schedules drive it, each fixed by the orders it has produced (saved orders must
not change):

* the Dataset's (:class:`FeistelPermutation`): one ``n`` and six round keys per
  ``(seed, epoch)``; balanced halves over the smallest power-of-four domain that holds
  ``n`` (less than ``4 * n``: fewer than four encryptions per position on average);
* the Mix's (:func:`keyed_bijection`): a size and a key per element, vectorised; the
  element's key xor six fixed round constants; unbalanced halves over the smallest
  power-of-two domain (>= 4) that holds the size (fewer than two on average).

Everything here is pure numpy: no torch, no I/O, and no array of size ``n``.
"""

from __future__ import annotations

import hashlib

import numpy as np
import numpy.typing as npt

__all__ = [
    "FeistelPermutation",
    "as_int64",
    "derive_keys",
    "feistel_walk",
    "keyed_bijection",
    "mix64",
    "sample_seeds",
]

I64 = npt.NDArray[np.int64]
U64 = npt.NDArray[np.uint64]
#: a scalar shared by every element, or one value per element
Word = np.uint64 | U64

_ROUNDS = 6
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)


def mix64(x: U64) -> U64:
    """SplitMix64's finaliser: a fast bijective mix of 64-bit words (wraps mod 2**64)."""
    if not isinstance(x, np.ndarray) or x.ndim == 0:
        x = x ^ (x >> _S30)
        x = x * _M1
        x = x ^ (x >> _S27)
        x = x * _M2
        return x ^ (x >> _S31)
    return _mix64_in_place(np.array(x, dtype=np.uint64))


def _mix64_in_place(x: U64) -> U64:
    """:func:`mix64` of an array of its own, computed in it (one temporary array)."""
    t = x >> _S30
    x ^= t
    x *= _M1
    np.right_shift(x, _S27, out=t)
    x ^= t
    x *= _M2
    np.right_shift(x, _S31, out=t)
    x ^= t
    return x


def derive_keys(domain: str, seed: int, epoch: int, count: int) -> list[int]:
    """``count`` 64-bit keys drawn from (domain, seed, epoch) by BLAKE2b.

    Keys for different domains ("shuffle", "sample", ...) are unrelated, which keeps
    the shuffle stream separate from the per-sample random streams.
    """
    digest = hashlib.blake2b(
        f"evenly/{domain}/{seed}/{epoch}".encode(), digest_size=8 * count
    ).digest()
    return [int.from_bytes(digest[8 * i : 8 * i + 8], "little") for i in range(count)]


def feistel_walk(values: U64, bound: Word, keys: list[Word], lbits: Word, rbits: Word) -> U64:
    """Encrypt each value of ``[0, bound)`` by the Feistel network, cycle walked into
    ``[0, bound)``.

    A value is ``left << rbits | right``; round ``r`` maps ``(left, right)`` to
    ``(right, left ^ (mix64(right ^ keys[r]) & mask))``, the two widths swapping.  Keys,
    widths and bound are scalars or one per element (then of the values' shape).

    >>> out = feistel_walk(np.arange(5, dtype=np.uint64), np.uint64(5), [np.uint64(9)] * 6,
    ...                    np.uint64(2), np.uint64(1))
    >>> sorted(out.tolist())
    [0, 1, 2, 3, 4]
    """
    out = _encrypt(values, keys, lbits, rbits)
    outside = np.flatnonzero(out >= bound)
    while outside.size:
        part = [_at(key, outside) for key in keys]
        out[outside] = _encrypt(out[outside], part, _at(lbits, outside), _at(rbits, outside))
        outside = outside[out[outside] >= _at(bound, outside)]
    return out


def _encrypt(x: U64, keys: list[Word], lbits: Word, rbits: Word) -> U64:
    one = np.uint64(1)
    lmask, rmask = (one << lbits) - one, (one << rbits) - one
    left, right = x >> rbits, x & rmask
    for key in keys:
        mixed = _mix64_in_place(right ^ key)
        mixed &= lmask
        mixed ^= left
        left, right = right, mixed
        lbits, rbits, lmask, rmask = rbits, lbits, rmask, lmask
    return (left << rbits) | right


def _at(word: Word, index: I64) -> Word:
    return word[index] if isinstance(word, np.ndarray) else word


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
        # the Dataset's key schedule: balanced halves, six keys from (seed, epoch)
        bits = max(2, (n - 1).bit_length()) if n > 1 else 2
        self._half = np.uint64((bits + 1) // 2)
        self._keys: list[Word] = [
            np.uint64(k) for k in derive_keys("shuffle", seed, epoch, _ROUNDS)
        ]

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
        out = feistel_walk(flat, np.uint64(self.n), self._keys, self._half, self._half)
        return out.astype(np.int64).reshape(pos.shape)


#: the Mix's round constants, xor-ed into each element's key
_MIX_ROUND_KEYS = [np.uint64(k) for k in derive_keys("mix-rounds", 0, 0, _ROUNDS)]


def keyed_bijection(values: I64, sizes: I64, keys: U64) -> I64:
    """Element ``i`` maps ``values[i]`` by a bijection of ``[0, sizes[i])`` keyed by
    ``keys[i]`` (the Mix's key schedule, see the module): vectorised over elements with
    different keys and sizes; sizes 0 and 1 map to themselves.

    >>> keys = np.full(5, 7, dtype=np.uint64)
    >>> sorted(keyed_bijection(np.arange(5), np.full(5, 5), keys).tolist())
    [0, 1, 2, 3, 4]
    """
    out = values.copy()
    sel = np.flatnonzero(sizes > 1)
    bits = np.maximum(2, _bit_length(sizes[sel] - 1)).astype(np.uint64)
    lbits = bits // np.uint64(2)
    round_keys: list[Word] = [keys[sel] ^ k for k in _MIX_ROUND_KEYS]
    bound = sizes[sel].astype(np.uint64)
    x = feistel_walk(values[sel].astype(np.uint64), bound, round_keys, lbits, bits - lbits)
    out[sel] = x.astype(np.int64)
    return out


def _bit_length(x: I64) -> I64:
    """``int.bit_length`` of each element of ``x`` (0 <= x < 2**53)."""
    return np.frexp(np.maximum(x, 0).astype(np.float64))[1].astype(np.int64)


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
