"""The sources of a mixture, concatenated: global index -> (source, local index), and
batched reads that ask each source once (no torch, no I/O of its own).

>>> s = Sources({"a": [1, 2, 3], "b": [10, 20]})
>>> s.source_of([0, 3, 4]).tolist(), s.read_many([4, 0, 3]), s.locate(3)
([0, 1, 1], [20, 1, 10], "source 'b' sample 0")
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

from evenly.core.source import SourceView

__all__ = ["Sources"]

I64 = npt.NDArray[np.int64]
_S = TypeVar("_S", bound="Sources")


class Sources:
    """Named sources read by global index (the index space of an ``evenly.Mix``)."""

    def __init__(self, sources: Mapping[str, Any]) -> None:
        self.names: tuple[str, ...] = tuple(str(name) for name in sources)
        self._sources = [sources[name] for name in sources]
        self._views = [SourceView.of(s) for s in self._sources]  # found once
        self.lengths: tuple[int, ...] = tuple(len(s) for s in self._sources)
        self._ends = np.cumsum(np.array(self.lengths, dtype=np.int64))
        self._base = self._ends - np.array(self.lengths, dtype=np.int64)

    @property
    def views(self) -> tuple[SourceView, ...]:
        """What each source offers (found once)."""
        return tuple(self._views)

    def source_of(self, indices: npt.ArrayLike) -> I64:
        """The source number (into ``names``) of each index, e.g. for per-source counts."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        total = int(self._ends[-1])
        if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= total):
            bad = int(idx[(idx < 0) | (idx >= total)][0])
            raise IndexError(
                f"evenly.Mix: index {bad} is out of range [0, {total}) (the concatenated "
                f"sources {dict(zip(self.names, self.lengths, strict=True))})"
            )
        return np.searchsorted(self._ends, idx, side="right").astype(np.int64)

    def copy_for_thread(self: _S) -> _S:
        """A reader thread's copy: each source's ``copy_for_thread()`` where it has one."""
        twin = copy.copy(self)
        twin._sources = [getattr(s, "copy_for_thread", lambda s=s: s)() for s in self._sources]
        twin._views = [SourceView.of(s) for s in twin._sources]
        return twin

    def read_one(self, index: int) -> Any:
        """The sample at global ``index`` (into the concatenated sources)."""
        (d,) = self.source_of([index]).tolist()
        return self._sources[d][int(index) - int(self._base[d])]

    def _per_source(self, indices: Sequence[int]) -> Any:
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        src = self.source_of(idx)
        for d in np.unique(src).tolist():
            where = np.flatnonzero(src == d)
            yield d, where, (idx[where] - self._base[d]).tolist()

    def read_many(self, indices: Sequence[int]) -> list[Any]:
        """Read a batch: each source once (its own ``__getitems__`` when it has one)."""
        out: list[Any] = [None] * len(indices)
        for d, where, local in self._per_source(indices):
            getitems = self._views[d].getitems
            if getitems is not None:
                samples = list(getitems(local))
            else:
                samples = [self._sources[d][i] for i in local]
            for pos, sample in zip(where.tolist(), samples, strict=True):
                out[pos] = sample
        return out

    @property
    def read_tokens(self) -> Callable[[Sequence[int], str], list[Any]] | None:
        """Packing's direct reads (each source's ``read_tokens``), where every source has
        them; else ``None`` (packing then reads the samples)."""
        if all(v.read_tokens is not None for v in self._views):
            return self._read_tokens
        return None

    def _read_tokens(self, indices: Sequence[int], field: str) -> list[Any]:
        out: list[Any] = [None] * len(indices)
        for d, where, local in self._per_source(indices):
            read = self._views[d].read_tokens
            assert read is not None
            for pos, sample in zip(where.tolist(), read(local, field), strict=True):
                out[pos] = sample
        return out

    def check_unchanged(self) -> None:
        """Raise if a source's files changed since it was opened (each source's own
        check, at every pass start)."""
        for view in self._views:
            if view.check_unchanged is not None:
                view.check_unchanged()

    def prefetch(self, indices: Sequence[int]) -> None:
        """Pass a prefetch hint on to the sources that take one."""
        for d, _, local in self._per_source(indices):
            prefetch = self._views[d].prefetch
            if prefetch is not None:
                prefetch(local)

    def locate(self, index: int) -> str:
        """Where sample ``index`` lives: the source's name and index (and its own locate)."""
        (d,) = self.source_of([index]).tolist()
        local = int(index) - int(self._base[d])
        where = f"source {self.names[d]!r} sample {local}"
        inner = self._views[d].locate
        return where + (f" ({inner(local)})" if inner is not None else "")
