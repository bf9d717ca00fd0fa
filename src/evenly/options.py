"""The string options of evenly's public API, as ``Literal`` types to annotate with.

Each alias lists the values its setting accepts; the tuples beside them are what the
settings are checked against at run time (a clear ``ValueError`` naming the valid ones),
so the two cannot drift apart.  Pure: no torch, no numpy.

>>> from evenly.options import Pad, PAD_MODES
>>> PAD_MODES
('repeat', 'none', 'mask')
>>> def make(pad: Pad = "mask") -> None: ...
"""

from __future__ import annotations

from typing import Literal, TypeAlias, get_args

__all__ = [
    "FORMATS",
    "GENERATORS",
    "ON_ERROR",
    "PAD_MODES",
    "SAMPLER_PADS",
    "SHUFFLE_MODES",
    "STRATEGIES",
    "TRANSPORTS",
    "UNITS",
    "WORKER_TYPES",
    "Format",
    "Generator",
    "OnError",
    "Pad",
    "SamplerPad",
    "Shuffle",
    "ShuffleMode",
    "Strategy",
    "Transport",
    "Unit",
    "WorkerType",
]

#: ``evenly.Dataset(shuffle=...)``: ``True`` takes the source's preferred mode.
Shuffle: TypeAlias = bool | Literal["global", "block"]
#: A resolved shuffle (``Dataset.shuffle_mode``): ``"none"`` is ``shuffle=False``.
ShuffleMode: TypeAlias = Literal["none", "global", "block"]
#: ``evenly.Dataset(pad=...)``: how the epoch's short last step is shared.
Pad: TypeAlias = Literal["repeat", "none", "mask"]
#: ``evenly.BatchSampler(pad=...)`` (``"mask"`` needs a per-sample transform).
SamplerPad: TypeAlias = Literal["repeat", "none"]
#: ``evenly.Dataset(on_error=...)``: a sample the source cannot read.
OnError: TypeAlias = Literal["raise", "skip"]
#: ``evenly.Dataset(seed_generators=...)``: the global generators seeded per sample.
Generator: TypeAlias = Literal["random", "numpy", "torch"]
#: ``evenly.DataLoader(transport=...)``: how workers hand batches over.
Transport: TypeAlias = Literal["slots", "copy", "torch"]
#: ``evenly.DataLoader(worker_type=...)``: who reads the ``num_workers`` shares.
WorkerType: TypeAlias = Literal["auto", "process", "thread"]
#: ``evenly.Packing(strategy=...)``.
Strategy: TypeAlias = Literal["concat", "best_fit"]
#: ``evenly.Mix(unit=...)``: what the weights apportion.
Unit: TypeAlias = Literal["samples", "tokens"]
#: ``evenly.write(format=...)``.
Format: TypeAlias = Literal["parquet", "arrow", "webdataset", "jsonl"]

SHUFFLE_MODES: tuple[ShuffleMode, ...] = get_args(ShuffleMode)
PAD_MODES: tuple[Pad, ...] = get_args(Pad)
SAMPLER_PADS: tuple[SamplerPad, ...] = get_args(SamplerPad)
ON_ERROR: tuple[OnError, ...] = get_args(OnError)
GENERATORS: tuple[Generator, ...] = get_args(Generator)
TRANSPORTS: tuple[Transport, ...] = get_args(Transport)
WORKER_TYPES: tuple[WorkerType, ...] = get_args(WorkerType)
STRATEGIES: tuple[Strategy, ...] = get_args(Strategy)
UNITS: tuple[Unit, ...] = get_args(Unit)
FORMATS: tuple[Format, ...] = get_args(Format)
