"""``evenly bench``'s measurements: a user's dataset run for a number of batches under
each configuration (mode x workers), figures from ``loader.stats()``.

A mode is a way to run the loader's workers: :data:`MODES` maps its name to the
``evenly.DataLoader`` keyword arguments for a number of workers.  A thread mode, when
the loader offers one, is one more entry there (and ``--modes`` picks it up).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Generator
from typing import Any

from evenly.bench._advice import Facts, Row
from evenly.runtime.clock import STAGES
from evenly.runtime.seeds import GENERATORS

__all__ = ["MODES", "facts_of", "measure", "split_factory_result"]

#: mode -> the DataLoader keyword arguments that run it with ``workers`` workers
MODES: dict[str, Callable[[int], dict[str, Any]]] = {
    "processes": lambda workers: {"num_workers": workers},
}


def split_factory_result(made: Any, where: str) -> tuple[Any, dict[str, Any]]:
    """A factory returns an ``evenly.Dataset``, or ``(dataset, DataLoader kwargs)``."""
    import evenly

    kwargs: dict[str, Any] = {}
    if isinstance(made, tuple) and len(made) == 2 and isinstance(made[1], dict):
        made, kwargs = made
    if not isinstance(made, evenly.Dataset):
        raise TypeError(
            f"evenly bench: {where} returned a {type(made).__name__}; it must return an "
            f"evenly.Dataset, or (dataset, dict of evenly.DataLoader keyword arguments)"
        )
    return made, dict(kwargs)


def facts_of(dataset: Any, kwargs: dict[str, Any]) -> Facts:
    source = dataset.source
    return Facts(
        source=type(source).__name__,
        shuffle=dataset.shuffle_mode,
        seeded=dataset.transform is not None and set(dataset.seed_generators) == set(GENERATORS),
        columnar=kwargs.get("columnar") is True,
        sharded=getattr(source, "shard_sizes", None) is not None,
    )


def _batches(loader: Any) -> Generator[Any, None, None]:
    while True:  # epoch after epoch, as long as the caller wants batches
        empty = True
        for batch in loader:
            empty = False
            yield batch
        if empty:
            raise ValueError("evenly bench: the dataset yields no batch")


def _totals(stats: Any) -> dict[str, float]:
    out = {"batches": 0.0, "samples": 0.0, "waited": 0.0}
    out.update({stage: 0.0 for stage in STAGES})
    for e in stats.epochs:
        out["batches"] += e.batches
        out["samples"] += e.samples
        out["waited"] += e.waited_seconds
        for stage, seconds in e.stages.items():
            out[stage] += seconds
    return out


def measure(
    dataset: Any,
    kwargs: dict[str, Any],
    *,
    mode: str,
    workers: int,
    batches: int,
    batch_size: int,
    warmup: int = 2,
) -> Row:
    """Run ``batches`` batches (after ``warmup`` untimed ones: workers starting)."""
    import evenly

    if mode not in MODES:
        raise ValueError(f"evenly bench: unknown mode {mode!r}; choose from {sorted(MODES)}")
    options = {**kwargs, **MODES[mode](workers), "batch_size": batch_size}
    loader = evenly.DataLoader(dataset, **options)
    stream = _batches(loader)
    try:
        for _ in range(warmup):
            next(stream)
        before = _totals(loader.stats())
        started = time.perf_counter()
        for _ in range(batches):
            next(stream)
        seconds = time.perf_counter() - started
        after = _totals(loader.stats())
    finally:
        stream.close()
        del stream, loader
        gc.collect()  # the workers of an abandoned pass stop now, not later
    delta = {k: after[k] - before[k] for k in after}
    done = max(delta["batches"], 1.0)
    return Row(
        mode=mode,
        workers=workers,
        samples_per_second=delta["samples"] / seconds if seconds > 0 else 0.0,
        waited_fraction=min(1.0, delta["waited"] / seconds) if seconds > 0 else 0.0,
        stages={stage: delta[stage] / done for stage in STAGES},
    )
