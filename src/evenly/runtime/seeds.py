"""Per-sample random streams for Python's ``random``, NumPy's global generator and torch's
default generator, kept apart from the user's own state.

Each sample's 64-bit seed (a function of seed, epoch and position only) is spread into
one state per generator, so the three streams are unrelated to each other:

- ``random`` and NumPy's global generator (both Mersenne Twisters) each get a full
  624-word state hashed from the seed, all of a batch's states computed at once and
  written straight into the generator (:mod:`evenly.runtime.mtstate`): the same state
  ``random.setstate`` / ``numpy.random.set_state`` would set, at a fraction of the cost
  of ``random.seed`` / ``numpy.random.seed``;
- torch's CPU generator gets another 64-bit value by ``manual_seed``; torch's Mersenne
  Twister keeps only the low 32 bits of any seed, so about ``N**2 / 2**33`` pairs of
  samples of an N-sample epoch share their torch draws (~116 pairs at N = 10**6).  That
  is torch's limit; if it matters, draw from a ``torch.Generator`` seeded with
  :func:`evenly.sample_seed`.

Seeding costs ~1-2 us per sample and generator (``bench/bench_core.py``); name only the
generators your transform uses (``seed_generators=``), or none and build your own
generator from :func:`sample_seed`.  The user's state of the seeded generators is saved
and restored once per batch.

The seed :func:`sample_seed` returns lives in a :class:`contextvars.ContextVar`, set
around each call of the transform and reset after it (each thread sees its own).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from contextvars import ContextVar
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

from evenly.core.permutation import mix64
from evenly.options import GENERATORS
from evenly.runtime.mtstate import MT_WORDS, global_bit_generator, numpy_writer, python_writer

__all__ = [
    "GENERATORS",
    "RngState",
    "SeedSpreader",
    "check_generators",
    "is_padding",
    "sample_seed",
]

_TORCH_KEY = np.uint64(0xBB67AE8584CAA73B)
#: one key per 64-bit word of the two Mersenne Twister states (random's, then numpy's)
_STATE_KEYS = mix64(
    np.arange(1, MT_WORDS + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    ^ np.uint64(0x6A09E667F3BCC909)
)
_HALF = MT_WORDS // 2  # 64-bit words per 624-word state
_MT_BYTES = 4 * MT_WORDS
_STATE_FACTOR = np.uint64(0xD6E8FEB86659FD93)
_S32 = np.uint64(32)
_BLOCK = 32  # samples whose states are computed together

#: The seed of the sample being transformed and whether it is padding (one variable:
#: one set and one reset per call); ``None`` outside a transform call.
_SAMPLE: ContextVar[tuple[int, bool] | None] = ContextVar("evenly.sample", default=None)
R = TypeVar("R")


def sample_seed() -> int:
    """The 64-bit seed of the sample being transformed (inside ``transform`` only).

    It depends on (seed, epoch, position in the epoch's order), never on ranks or
    workers.  Use it to seed your own generator instead of the global ones:

    >>> import evenly, numpy as np
    >>> def augment(x):
    ...     rng = np.random.default_rng(evenly.sample_seed())
    ...     return x + rng.integers(0, 10)
    >>> ds = evenly.Dataset(list(range(4)), transform=augment, seed_generators=())
    >>> len(list(ds))
    4
    """
    current = _SAMPLE.get()
    if current is None:
        raise RuntimeError(
            "evenly.sample_seed() is only available inside an evenly.Dataset transform"
        )
    return current[0]


def is_padding() -> bool:
    """Whether the sample being transformed is padding (inside ``transform`` only).

    With ``evenly.Dataset(..., pad="mask")`` the epoch's short last step is filled with
    repeats, as with the default, so every rank keeps the same number of batches, and the
    transform is told which samples are those repeats, to mark them for the loss or the
    metric (a label of -100 for ``ignore_index``, a weight of 0):

    >>> import evenly, warnings
    >>> def mark(x):
    ...     return {"x": x, "weight": 0.0 if evenly.is_padding() else 1.0}
    >>> def epoch(rank):
    ...     ds = evenly.Dataset(list(range(3)), rank=rank, world_size=2, pad="mask",
    ...                         transform=mark)
    ...     with warnings.catch_warnings():
    ...         warnings.simplefilter("ignore", evenly.EvenlyWarning)  # 1 sample repeated
    ...         return [(s["x"], s["weight"]) for s in ds]
    >>> epoch(0), epoch(1)
    ([(0, 1.0), (2, 1.0)], [(1, 1.0), (0, 0.0)])
    """
    current = _SAMPLE.get()
    if current is None:
        raise RuntimeError(
            "evenly.is_padding() is only available inside an evenly.Dataset transform"
        )
    return current[1]


def check_generators(names: Iterable[str]) -> tuple[str, ...]:
    """Validate ``seed_generators``: a subset of ('random', 'numpy', 'torch')."""
    if isinstance(names, str):
        names = (names,)
    chosen = tuple(dict.fromkeys(names))
    unknown = [n for n in chosen if n not in GENERATORS]
    if unknown:
        raise ValueError(
            f"seed_generators: unknown generator(s) {unknown}; choose from {list(GENERATORS)} "
            f"(or () to seed none and use evenly.sample_seed())"
        )
    return chosen


_mix = mix64


class SeedSpreader:
    """Seeds the chosen generators for each sample of a batch.

    >>> spreader = SeedSpreader(("numpy",))
    >>> spreader.prepare(np.array([1, 2], dtype=np.uint64))
    >>> spreader.seed(0); a = np.random.random()
    >>> spreader.seed(1); b = np.random.random()
    >>> spreader.seed(0); a == np.random.random() != b
    True
    """

    def __init__(self, generators: tuple[str, ...]) -> None:
        import torch

        self.generators = generators
        self._random = "random" in generators
        self._numpy = "numpy" in generators
        self._torch = "torch" in generators
        self._gen = torch.default_generator
        self._py: list[int] = []
        self._th: list[int] = []
        self._keys = np.concatenate(
            [_STATE_KEYS[:_HALF]] * self._random + [_STATE_KEYS[_HALF:]] * self._numpy
            or [_STATE_KEYS[:0]]
        )
        self._states = np.empty((0, self._keys.size), dtype=np.uint64)
        self._scratch = self._states.copy()
        self._base, self._stride = 0, 0
        self._write_py = python_writer() if self._random else None
        self._bit_generator: Any = None
        self._np_dirty = True

    def prepare(self, seeds: npt.NDArray[np.uint64]) -> None:
        """Compute a batch's per-sample states of the chosen generators (vectorised)."""
        self._py = seeds.tolist()
        if self._keys.size:  # one buffer per spreader, reused batch after batch
            if len(self._states) < len(seeds):
                self._states = np.empty((len(seeds), self._keys.size), dtype=np.uint64)
                self._scratch = np.empty_like(self._states)
            states, scratch = self._states[: len(seeds)], self._scratch[: len(seeds)]
            # word j of a sample's states: (seed ^ key_j) * odd, xor-folded (a bijection of
            # seed ^ key_j; the keys are mixed constants, the seeds already mix64 outputs)
            # in blocks of rows that stay in the CPU cache between the four passes
            column, keys = seeds.astype(np.uint64)[:, None], self._keys[None, :]
            for lo in range(0, len(seeds), _BLOCK):
                block, spare = states[lo : lo + _BLOCK], scratch[lo : lo + _BLOCK]
                np.bitwise_xor(column[lo : lo + _BLOCK], keys, out=block)
                np.multiply(block, _STATE_FACTOR, out=block)
                np.right_shift(block, _S32, out=spare)
                np.bitwise_xor(block, spare, out=block)
            self._base, self._stride = states.ctypes.data, states.strides[0]
        if self._numpy:
            bit_generator = global_bit_generator()
            if bit_generator is not self._bit_generator:  # first batch, or replaced
                self._bit_generator = bit_generator
                self._write_np, self._np_touched = numpy_writer()
            self._np_dirty = True  # the user's state may hold a cached Gaussian
        if self._torch:
            self._th = _mix(seeds ^ _TORCH_KEY).tolist()

    def seed(self, i: int) -> None:
        """Seed the chosen generators for sample ``i`` of the prepared batch."""
        if not 0 <= i < len(self._py):  # the states are read by address: never past them
            raise IndexError(f"sample {i} of a prepared batch of {len(self._py)}")
        row = self._base + i * self._stride
        write_py = self._write_py
        if write_py is not None:
            write_py(row)
            row += _MT_BYTES
        if self._numpy:
            if self._np_dirty or self._np_touched():
                np.random.seed(0)  # only to clear the legacy cached Gaussian
            self._write_np(row)
            self._np_dirty = False
        if self._torch:
            self._gen.manual_seed(self._th[i])

    def call(self, i: int, fn: Callable[[Any], R], sample: Any, padding: bool = False) -> R:
        """``fn(sample)`` for sample ``i``: the generators seeded, and
        :func:`sample_seed` giving its seed (and :func:`is_padding` whether it is a pad)
        during the call (only then).

        >>> spreader = SeedSpreader(())
        >>> spreader.prepare(np.array([7], dtype=np.uint64))
        >>> spreader.call(0, lambda x: (x, sample_seed()), "a")
        ('a', 7)
        """
        self.seed(i)
        token = _SAMPLE.set((self._py[i], padding))
        try:
            return fn(sample)
        finally:
            _SAMPLE.reset(token)


class RngState:
    """A snapshot of the chosen global generators, to put back after seeding them."""

    __slots__ = ("_numpy", "_python", "_torch")

    def __init__(self, generators: tuple[str, ...] = GENERATORS) -> None:
        import torch

        self._python: Any = random.getstate() if "random" in generators else None
        self._numpy: Any = np.random.get_state() if "numpy" in generators else None
        self._torch = torch.default_generator.get_state() if "torch" in generators else None

    def restore(self) -> None:
        import torch

        if self._python is not None:
            random.setstate(self._python)
        if self._numpy is not None:
            np.random.set_state(self._numpy)
        if self._torch is not None:
            torch.default_generator.set_state(self._torch)
