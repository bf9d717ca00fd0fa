"""The orders pinned in ``tests/data/order_pins.json``: the cases and how each is computed.

``tests/scripts/record_order_pins.py`` wrote the file from the code as it was before the
Feistel networks of the Dataset and of the Mix became one (commit 90e5c94);
``tests/test_order_pins.py`` asserts that the code still computes every value.  A pinned
order is the spec of "no saved order changes" (DECISIONS.md): never re-record it to make a
test pass.

Each case gives an int64 array; the file keeps its length, the first 16 hex digits of the
SHA-256 of its little-endian bytes, and its first values.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import numpy.typing as npt

import evenly
from evenly.core.block import BlockPermutation
from evenly.core.mix.apportion import epoch_offsets, mix_counts
from evenly.core.mix.order import MixOrder
from evenly.core.permutation import FeistelPermutation, keyed_bijection

I64 = npt.NDArray[np.int64]
#: values kept in clear per case (the hash covers the rest)
HEAD = 12

_BIG_SEED = 2**63 - 25


def _sampled(n: int, count: int, salt: int) -> I64:
    """``count`` positions of ``[0, n)``: both ends, then uniform draws."""
    rng = np.random.default_rng(salt)
    ends = np.array([0, 1, n // 2, n - 2, n - 1], dtype=np.int64)
    draws = rng.integers(0, n, size=count - ends.size, dtype=np.int64)
    return np.concatenate([ends, draws])


def feistel_cases() -> list[dict[str, Any]]:
    """Whole permutations of small and medium ``n``; sampled positions of huge ``n``."""
    cases: list[dict[str, Any]] = []
    sizes = [0, 1, 2, 3, 4, 5, 7, 8, 9, 10, 16, 17, 31, 64, 100, 255, 1000, 4097, 99_991]
    keys = [(0, 0), (1, 0), (0, 1), (7, 3), (-5, 2), (_BIG_SEED, 1000)]
    for i, n in enumerate(sizes):
        seed, epoch = keys[i % len(keys)]
        cases.append({"n": n, "seed": seed, "epoch": epoch})
        if n in (10, 1000):
            cases.extend({"n": n, "seed": s, "epoch": e} for s, e in keys)
    cases.append({"n": 10**6 + 3, "seed": 0, "epoch": 0})
    cases.append({"n": 2**20, "seed": 42, "epoch": 7})
    for n, seed in [(10**9 + 7, 3), (2**40 + 1, 11), (2**61 - 1, _BIG_SEED)]:
        cases.append({"n": n, "seed": seed, "epoch": 2, "sample": 10**6 if n < 2**40 else 50_000})
    return cases


def feistel(case: dict[str, Any]) -> I64:
    perm = FeistelPermutation(case["n"], seed=case["seed"], epoch=case["epoch"])
    if "sample" in case:
        return perm(_sampled(case["n"], case["sample"], salt=case["n"] % 1000))
    return perm(np.arange(case["n"], dtype=np.int64))


def bijection_cases() -> list[dict[str, Any]]:
    """Mixed sizes (0, 1, 2, powers of two, primes, up to 2**40) and keys per element."""
    return [
        {"count": 4000, "max_size": 1000, "salt": 1},
        {"count": 4000, "max_size": 70_000, "salt": 2},
        {"count": 2000, "max_size": 2**40, "salt": 3},
        {"count": 64, "max_size": 4, "salt": 4},
        {"whole": 97, "key": 5},
        {"whole": 128, "key": 2**64 - 1},
        {"whole": 4096, "key": 123_456_789},
    ]


def bijection(case: dict[str, Any]) -> I64:
    if "whole" in case:
        size = case["whole"]
        keys = np.full(size, case["key"], dtype=np.uint64)
        return keyed_bijection(np.arange(size, dtype=np.int64), np.full(size, size), keys)
    rng = np.random.default_rng(case["salt"])
    sizes = rng.integers(0, case["max_size"], size=case["count"], dtype=np.int64)
    sizes[:8] = [0, 1, 2, 3, 4, 5, 8, 9][:8]
    values = (rng.random(case["count"]) * np.maximum(sizes, 1)).astype(np.int64)
    values[sizes == 0] = 0
    keys = rng.integers(0, 2**64, size=case["count"], dtype=np.uint64)
    return keyed_bijection(values, sizes, keys)


def block_cases() -> list[dict[str, Any]]:
    sizes_a = [3, 0, 4, 2, 0, 5, 1, 7]
    sizes_b = [int(x) for x in np.random.default_rng(9).integers(0, 300, size=40)]
    return [
        {"sizes": sizes_a, "window": 2, "seed": 0, "epoch": 0},
        {"sizes": sizes_a, "window": 3, "seed": 1, "epoch": 2},
        {"sizes": sizes_a, "window": 8, "seed": 5, "epoch": 1},
        {"sizes": sizes_b, "window": 4, "seed": 7, "epoch": 0},
        {"sizes": sizes_b, "window": 4, "seed": 7, "epoch": 1},
        {"sizes": sizes_b, "window": 1, "seed": _BIG_SEED, "epoch": 3},
        {"sizes": [1], "window": 1, "seed": 0, "epoch": 0},
        {"sizes": [0, 0, 2], "window": 2, "seed": 3, "epoch": 0},
    ]


def block(case: dict[str, Any]) -> I64:
    perm = BlockPermutation(case["sizes"], case["window"], seed=case["seed"], epoch=case["epoch"])
    return perm(np.arange(perm.n, dtype=np.int64))


def mix_order_cases() -> list[dict[str, Any]]:
    """MixOrder over several epochs, with and without shuffle, majors and minors, a
    resume history; each case pins the order and the (source, item) of every position."""
    three = {"lengths": [50, 20, 7], "weights": [0.6, 0.3, 0.1], "samples": 90}
    minors = {"lengths": [400, 9, 5, 3], "weights": [0.9, 0.05, 0.03, 0.02], "samples": 500}
    cases: list[dict[str, Any]] = []
    for shuffle in (False, True):
        for epoch in range(3):
            cases.append({**three, "seed": 0, "epoch": epoch, "shuffle": shuffle, "step": 8})
    cases.append({**three, "seed": 3, "epoch": 4, "shuffle": True, "step": 1})
    cases.append({**minors, "seed": 1, "epoch": 0, "shuffle": True, "step": 16})
    cases.append({**minors, "seed": 1, "epoch": 2, "shuffle": True, "step": 12, "hold": 4})
    cases.append(
        {
            **minors,
            "seed": 2,
            "epoch": 1,
            "shuffle": True,
            "step": 6,
            "start": 96,
            "history": [[0, 16], [48, 8]],
            "hold": 4,
        }
    )
    cases.append(
        {
            "lengths": [5, 3],
            "weights": None,
            "samples": None,
            "seed": 0,
            "epoch": 0,
            "shuffle": True,
            "step": 4,
        }
    )
    cases.append(
        {
            "lengths": [10**6, 3000],
            "weights": [1, 1],
            "samples": 20_000,
            "seed": _BIG_SEED,
            "epoch": 5,
            "shuffle": True,
            "step": 64,
        }
    )
    return cases


def mix_order(case: dict[str, Any]) -> I64:
    names = [f"s{d}" for d in range(len(case["lengths"]))]
    counts = mix_counts(case["lengths"], case["weights"], case["samples"])
    order = MixOrder(
        case["lengths"],
        counts,
        epoch_offsets(counts, case["epoch"]),
        names=names,
        seed=case["seed"],
        epoch=case["epoch"],
        shuffle=case["shuffle"],
        step=case["step"],
        start=case.get("start", 0),
        history=[tuple(h) for h in case.get("history", ())],
        hold=case.get("hold"),
    )
    positions = np.arange(len(order), dtype=np.int64)
    src, item = order.locate(positions)
    return np.concatenate([order(positions), src, item])


def mix_cases() -> list[dict[str, Any]]:
    """``evenly.Mix.epoch_order`` for a few epochs (named sources, weights by name)."""
    cases: list[dict[str, Any]] = []
    for shuffle in (False, True):
        for epoch in (0, 1, 2, 5):
            cases.append({"seed": 11, "epoch": epoch, "shuffle": shuffle, "step": 10})
    cases.append({"seed": 0, "epoch": 3, "shuffle": True, "step": 3, "min_step": 3})
    return cases


def mix(case: dict[str, Any]) -> I64:
    sources = {"web": list(range(100)), "code": list(range(37)), "math": list(range(11))}
    m = evenly.Mix(
        sources,
        weights={"web": 0.5, "code": 0.3, "math": 0.2},
        samples_per_epoch=120,
        min_step=case.get("min_step"),
    )
    order = m.epoch_order(case["seed"], case["epoch"], shuffle=case["shuffle"], step=case["step"])
    return np.asarray(order(range(len(m))), dtype=np.int64)


def dataset_cases() -> list[dict[str, Any]]:
    """End to end: what ``evenly.DataLoader`` yields to each of 2 ranks over 2 epochs."""
    return [
        {"source": "list", "shuffle": True, "seed": 3, "batch_size": 4},
        {"source": "list", "shuffle": False, "seed": 0, "batch_size": 3},
        {"source": "mix", "shuffle": True, "seed": 5, "batch_size": 4},
    ]


def dataset(case: dict[str, Any]) -> I64:
    out: list[int] = []
    for rank in range(2):
        if case["source"] == "mix":
            source: Any = evenly.Mix(
                {"a": list(range(40)), "b": list(range(100, 113))},
                weights={"a": 2, "b": 1},
                samples_per_epoch=45,
            )
        else:
            source = list(range(53))
        ds = evenly.Dataset(
            source, shuffle=case["shuffle"], seed=case["seed"], rank=rank, world_size=2
        )
        loader = evenly.DataLoader(ds, batch_size=case["batch_size"], num_workers=0)
        for _ in range(2):
            out.extend(int(x) for batch in loader for x in batch)
    return np.asarray(out, dtype=np.int64)


KINDS = {
    "feistel": (feistel_cases, feistel),
    "keyed_bijection": (bijection_cases, bijection),
    "block": (block_cases, block),
    "mix_order": (mix_order_cases, mix_order),
    "mix": (mix_cases, mix),
    "dataset": (dataset_cases, dataset),
}


def digest(values: I64) -> dict[str, Any]:
    """What the pin file keeps of one output."""
    arr = np.ascontiguousarray(values, dtype="<i8")
    return {
        "len": int(arr.size),
        "sha256": hashlib.sha256(arr.tobytes()).hexdigest()[:16],
        "head": arr[:HEAD].tolist(),
    }
