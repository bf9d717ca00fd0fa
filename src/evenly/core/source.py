"""What a source is: the protocol ``evenly.Dataset`` reads."""

from __future__ import annotations

from typing import Protocol, TypeVar

__all__ = ["Source"]

T_co = TypeVar("T_co", covariant=True)


class Source(Protocol[T_co]):
    """What ``evenly.Dataset`` reads: anything with ``__len__`` and ``__getitem__``.

    A source may also define ``__getitems__(indices)`` (torch's batched-fetch hook) to
    read a whole batch at once.
    """

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> T_co: ...
