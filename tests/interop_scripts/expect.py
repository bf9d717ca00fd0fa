"""What every interop test asserts about the sample ids the training steps received."""

from __future__ import annotations

from collections import Counter

#: One epoch as the training steps saw it: per rank, the list of batches (lists of ids).
Epoch = list[list[list[int]]]


def assert_exactly_once(epoch: Epoch, n: int, world: int, what: str) -> None:
    """Every one of the ``n`` samples arrives across the ranks, at most ``world - 1``
    repeats (the minimal padding that keeps the ranks equal), and no id outside the data."""
    counts = Counter(i for rank in epoch for batch in rank for i in batch)
    missing = sorted(set(range(n)) - set(counts))
    unknown = sorted(set(counts) - set(range(n)))
    repeats = sum(counts.values()) - len(counts)
    assert not missing and not unknown, (
        f"{what}: {len(missing)} of {n} samples never delivered (first: {missing[:5]}), "
        f"unknown ids {unknown[:5]}; {sum(counts.values())} delivered"
    )
    assert repeats <= world - 1, (
        f"{what}: {repeats} samples delivered twice (at most {world - 1} padding repeats)"
    )


def assert_equal_batches(epoch: Epoch, what: str) -> None:
    """Every rank's training step ran the same number of times."""
    counts = [len(rank) for rank in epoch]
    assert len(set(counts)) == 1, f"{what}: batch counts per rank differ: {counts}"


def assert_order_changes(first: Epoch, second: Epoch, what: str) -> None:
    """The second epoch is not a replay of the first (rank 0's order differs)."""
    a = [i for batch in first[0] for i in batch]
    b = [i for batch in second[0] for i in batch]
    assert a != b, f"{what}: epoch 1 repeats epoch 0's order on rank 0"


def join(*parts: Epoch) -> Epoch:
    """Concatenate per-rank batch lists (the two halves of an interrupted epoch)."""
    return [[batch for part in parts for batch in part[r]] for r in range(len(parts[0]))]
