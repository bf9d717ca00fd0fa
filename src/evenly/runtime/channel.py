"""Shared memory between the main process and DataLoader workers (persistent ones too,
and ones started with spawn or forkserver, which receive the tensors by handle).

:class:`PassChannel` holds the spec of the pass in progress, published by its owner in
the main process before the workers are asked for data.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from evenly.core.spec import PassSpec

__all__ = ["PassChannel", "SharedJson"]


#: Bytes a shared value may take (a Mix's part grows with its sources and resume steps).
CAPACITY = 1 << 16


class SharedJson:
    """One JSON-serialisable value in shared memory: its length (0: none yet) and bytes."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._length: torch.Tensor = torch.zeros(1, dtype=torch.int64).share_memory_()  # type: ignore[no-untyped-call]
        self._bytes: torch.Tensor = torch.zeros(CAPACITY, dtype=torch.uint8).share_memory_()  # type: ignore[no-untyped-call]

    def publish_bytes(self, data: bytes) -> None:
        if len(data) > CAPACITY:
            raise ValueError(
                f"evenly: {self.what} takes {len(data)} bytes, more than the {CAPACITY} that "
                f"shared memory holds for it (a Mix with very many sources or resume steps)"
            )
        self._bytes[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self._length[0] = len(data)

    def read_bytes(self) -> bytes | None:
        length = int(self._length[0])
        return self._bytes[:length].numpy().tobytes() if length else None

    def publish(self, value: Any) -> None:
        self.publish_bytes(json.dumps(value, separators=(",", ":")).encode())

    def read(self) -> Any:
        data = self.read_bytes()
        return None if data is None else json.loads(data)


class PassChannel:
    """The spec of the pass in progress, published by its owner in the main process."""

    def __init__(self) -> None:
        self._shared = SharedJson("the pass spec")

    def publish(self, spec: PassSpec) -> None:
        self._shared.publish_bytes(spec.encode())

    def read(self) -> PassSpec | None:
        data = self._shared.read_bytes()
        return None if data is None else PassSpec.decode(data)
