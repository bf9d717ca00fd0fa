"""Put Python's ``random`` and NumPy's global generator into a given Mersenne Twister
state (624 32-bit words), fast.

``random.seed(s)`` and ``numpy.random.seed([lo, hi])`` each spend ~5-10 us per call (the
init-by-array recurrence and argument checks); evenly instead derives each sample's 624
words in bulk per batch (vectorised) and writes them into the generator:

- NumPy: by ``memmove`` into the state struct ``MT19937.ctypes.state_address`` points
  at (``uint32 key[624]; int pos``), verified once per process against
  ``bit_generator.state``;
- ``random``: by ``memmove`` into the ``_random.Random`` object (``int index;
  uint32 state[624]``), whose offset is found and verified once per process against
  ``random.getstate()``.

Where a check fails (another interpreter, another layout), the same words are set by
``random.setstate`` / ``numpy.random.set_state``: slower, and the same streams.
"""

from __future__ import annotations

import ctypes
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["MT_WORDS", "global_bit_generator", "numpy_writer", "python_writer"]

MT_WORDS = 624
_BYTES = 4 * MT_WORDS
#: sets a generator's state from the address of 624 C-contiguous uint32 words
Writer = Callable[[int], None]


def _words_at(address: int) -> npt.NDArray[np.uint32]:
    return np.ctypeslib.as_array((ctypes.c_uint32 * MT_WORDS).from_address(address)).copy()


def _probe_words() -> npt.NDArray[np.uint32]:
    return (np.arange(1, MT_WORDS + 1, dtype=np.uint64) * np.uint64(0x9E3779B1)).astype(np.uint32)


def python_writer(inst: random.Random | None = None, direct: bool = True) -> Writer:
    """A function that puts ``inst`` (default: the one behind ``random.random``) into the
    state given by 624 words, as ``inst.setstate((3, (*words, 624), None))`` would
    (``direct=False``: by that call)."""
    inst = random._inst if inst is None else inst  # type: ignore[attr-defined]
    assert inst is not None

    def slow(address: int) -> None:
        inst.setstate((3, (*_words_at(address).tolist(), MT_WORDS), None))

    offset = _python_offset(inst) if direct else None
    if offset is None:
        return slow
    index = ctypes.c_int.from_address(id(inst) + offset - 4)
    target = id(inst) + offset
    memmove = ctypes.memmove

    def fast(address: int) -> None:
        memmove(target, address, _BYTES)
        index.value = MT_WORDS
        inst.gauss_next = None  # type: ignore[attr-defined]

    return fast if _verified(fast, slow, inst.getstate, inst.setstate) else slow


def _python_offset(inst: random.Random) -> int | None:
    """Where the 624 state words sit in ``inst`` (after its ``int index``), or None."""
    saved = inst.getstate()
    try:
        inst.seed(20240229)
        version, internal, _ = inst.getstate()
        if version != 3 or len(internal) != MT_WORDS + 1:
            return None
        words = np.array(internal[:MT_WORDS], dtype=np.uint32).tobytes()
        pattern = np.array([internal[MT_WORDS]], dtype=np.int32).tobytes() + words
        size = type(inst).__basicsize__
        if size < len(pattern):
            return None
        found = ctypes.string_at(id(inst), size).find(pattern)
        return None if found < 0 else found + 4
    finally:
        inst.setstate(saved)


def numpy_writer(direct: bool = True) -> tuple[Writer, Callable[[], bool]]:
    """A function that puts NumPy's global generator into the state given by 624 words
    (as ``np.random.set_state(('MT19937', words, 624))``, except the cached Gaussian: see
    below), and one that says whether the generator was drawn from since the last write
    (``direct=False``: by that call, and always "drawn from").

    The legacy ``RandomState`` caches every second normal variate; after a write that
    cache still holds what the previous draws left, so the caller resets it (one
    ``np.random.seed``) before the next write whenever the generator was drawn from.
    """
    bit_generator = global_bit_generator()

    def slow(address: int) -> None:
        np.random.set_state(("MT19937", _words_at(address), MT_WORDS, 0, 0.0))

    def always() -> bool:
        return True

    address = getattr(getattr(bit_generator, "ctypes", None), "state_address", None)
    if not direct or type(bit_generator).__name__ != "MT19937" or not isinstance(address, int):
        return slow, always
    state = (ctypes.c_uint32 * (MT_WORDS + 1)).from_address(address)
    memmove = ctypes.memmove
    written = [0, 0]

    def fast(source: int) -> None:
        memmove(address, source, _BYTES)
        state[MT_WORDS] = MT_WORDS
        written[0], written[1] = state[0], state[1]

    def touched() -> bool:
        return state[MT_WORDS] != MT_WORDS or state[0] != written[0] or state[1] != written[1]

    def read() -> Any:
        return np.random.get_state(legacy=False)

    def key(value: Any) -> Any:
        return value["state"]  # not the cached Gaussian, which the caller resets

    if not _verified(fast, slow, read, np.random.set_state, key):
        return slow, always
    return fast, touched


def global_bit_generator() -> Any:
    """The bit generator behind ``numpy.random.random`` & co."""
    getter = getattr(np.random, "get_bit_generator", None)  # numpy >= 1.25
    if getter is not None:
        return getter()
    return np.random.mtrand._rand._bit_generator


def _verified(
    fast: Writer,
    slow: Writer,
    read: Callable[[], Any],
    load: Callable[[Any], Any],
    part: Callable[[Any], Any] = lambda state: state,
) -> bool:
    """Whether ``fast`` leaves the state ``slow`` does (the user's state is put back)."""
    words = _probe_words()
    saved = read()
    try:
        slow(words.ctypes.data)
        expected = part(read())
        load(saved)
        fast(words.ctypes.data)
        return _same(part(read()), expected)
    except Exception:
        return False
    finally:
        load(saved)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return bool(np.array_equal(a, b))
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)
