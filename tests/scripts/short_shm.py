"""Run under a small /dev/shm (tests/test_transport.py mounts one in a private mount
namespace): batches that do not fit the slots go torch's way and cannot all fit in
/dev/shm either.  Exits with the error evenly raised, or 0 if every epoch completed."""

from __future__ import annotations

import sys

import torch

import evenly


class Big:
    """Samples of 1 MiB each (a batch of 4: 4 MiB)."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.full((256 * 1024,), float(index))


def main() -> int:
    ds = evenly.Dataset(Big(), shuffle=True)
    loader = evenly.DataLoader(ds, batch_size=4, num_workers=2, prefetch_factor=4)
    held = []
    try:
        for batch in loader:
            held.append(batch)  # the loop keeps its batches: shared memory fills up
    except RuntimeError as exc:
        print(f"raised: {exc}", file=sys.stderr)
        return 3
    print(f"completed: {len(held)} batches", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
