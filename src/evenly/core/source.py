"""What a source is, and what it may offer: the protocols ``evenly.Dataset`` reads.

A source needs ``__len__`` and ``__getitem__``.  Everything else is optional and said by
a protocol below; :class:`SourceView` finds what a source offers once, when the dataset
is built (or its source replaced), so that no hot path asks ``getattr``.

>>> view = SourceView.of([10, 20, 30])
>>> view.getitems is None, view.shard_sizes, view.fingerprint
(True, None, None)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, runtime_checkable

from evenly.core.plan import Order

__all__ = [
    "BatchedSource",
    "CheckedSource",
    "ColumnarSource",
    "ContentKeyedSource",
    "GroupedColumnarSource",
    "IdentifiedSource",
    "LocatingSource",
    "PlannedSource",
    "PrefetchingSource",
    "ShardedSource",
    "Source",
    "SourceView",
    "TokenLengthsSource",
    "TokenRangesSource",
    "TokenReadingSource",
]

T_co = TypeVar("T_co", covariant=True)


class Source(Protocol[T_co]):
    """What ``evenly.Dataset`` reads: anything with ``__len__`` and ``__getitem__``.

    A source may also define ``__getitems__(indices)`` (torch's batched-fetch hook) to
    read a whole batch at once, and any of the optional protocols of this module.
    """

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> T_co: ...


@runtime_checkable
class BatchedSource(Protocol):
    """Reads a batch of indices in one call (torch's batched-fetch hook)."""

    def __getitems__(self, indices: Sequence[int]) -> list[Any]: ...


@runtime_checkable
class PrefetchingSource(Protocol):
    """Told the indices of the next batches ahead of reading them."""

    def prefetch(self, indices: Sequence[int]) -> None: ...


@runtime_checkable
class LocatingSource(Protocol):
    """Names where a sample lives (a file and row) for error messages."""

    def locate(self, index: int) -> str: ...


@runtime_checkable
class ColumnarSource(Protocol):
    """Reads a batch column by column (no per-sample Python objects)."""

    def read_columns(self, indices: Sequence[int]) -> dict[str, Any]: ...


@runtime_checkable
class GroupedColumnarSource(Protocol):
    """Reads several batches column by column in one call (one lookup and one check of
    its files for all of them): ``read_column_batches(batches)[j]`` equals
    ``read_columns(batches[j])``.  The reader then passes each batch's indices as an
    int64 numpy array (to both methods), and reads a group that fails again batch by
    batch with ``read_columns``, so the reads must have no side effects."""

    def read_column_batches(self, batches: Sequence[Sequence[int]]) -> list[dict[str, Any]]: ...


@runtime_checkable
class ShardedSource(Protocol):
    """Stored in shards: their sizes (for the block shuffle)."""

    shard_sizes: Sequence[int]


@runtime_checkable
class CheckedSource(Protocol):
    """Can tell, cheaply, that its files are still the ones it opened (at a pass start)."""

    def check_unchanged(self) -> None: ...


@runtime_checkable
class TokenLengthsSource(Protocol):
    """Knows how many tokens each document holds (packing's lengths, with no read of the
    tokens): one non-negative int32 per sample, in index order, for the token-id list
    ``field`` (``evenly.Packing(field=...)``).  Arrow, Parquet and HF ``datasets``
    sources answer from the list offsets; a source that cannot answer for ``field``
    raises (a ``ValueError`` or ``TypeError`` naming it)."""

    def token_lengths(self, field: str) -> Any: ...


@runtime_checkable
class TokenReadingSource(Protocol):
    """Reads documents' token ids directly: for ``indices``, one 1-D integer array per
    document (the list ``field``), in the order asked, with no row dicts (packing's reads
    when there is no transform and no tokenizer).  Arrow, Parquet and HF ``datasets``
    sources slice the column's values; Megatron files return views of the memory map."""

    def read_tokens(self, indices: Sequence[int], field: str) -> list[Any]: ...


@runtime_checkable
class TokenRangesSource(Protocol):
    """Locates documents' token ids in one window over its memory (local Arrow files):
    ``token_ranges(indices, field)`` gives ``(span, starts, lengths)``, the window (its
    ``gather(starts, lengths, out)`` copies ranges out), where each document starts in
    it and how many tokens it holds; or None where documents are read one by one."""

    def token_ranges(self, indices: Any, field: str) -> Any: ...


@runtime_checkable
class IdentifiedSource(Protocol):
    """Has an identity that changes when its data does (checked on resume)."""

    fingerprint: str


@runtime_checkable
class ContentKeyedSource(Protocol):
    """Names its content on this machine: ``content_key()`` changes whenever the data
    may have (a file's size, mtime, ctime and inode; an object's ETag; an HF dataset's
    fingerprint), where ``fingerprint`` (kept by copies, for checkpoints) may not.  It
    keys what evenly caches about the data (packing's lengths and plans); a source
    without it is keyed by its ``fingerprint``, which must then change with its data."""

    def content_key(self) -> str: ...


@runtime_checkable
class PlannedSource(Protocol):
    """Plans its own epochs (``evenly.Mix``): the order, and its part of a checkpoint.
    It is read by global index with ``read_one``/``read_many`` (it is not a sequence).

    What a pass over it carries (``part``: JSON-serialisable, from a loaded state) lives
    in the pass state of the owner, and reaches the workers in the pass spec."""

    def epoch_order(
        self, seed: int, epoch: int, *, shuffle: bool, step: int, start: int = 0, part: Any = None
    ) -> Order: ...

    def source_state(
        self, epoch: int, position: int, part: Any = None, order: Any = None
    ) -> dict[str, Any]: ...

    def load_source_state(self, state: Any, epoch: int, position: int) -> Any: ...

    def carried_part(self, part: Any) -> Any: ...

    def reweighted(self, state: Any, weights: Mapping[str, float]) -> dict[str, Any]: ...

    def read_one(self, index: int) -> Any: ...

    def read_many(self, indices: Sequence[int]) -> list[Any]: ...


@dataclass(frozen=True)
class SourceView:
    """What one source offers, found once: each field is the source's own method or
    value, or ``None`` where it offers none."""

    source: Any
    #: the sample at an index (``source[i]``, or a planned source's ``read_one``)
    read_one: Callable[[int], Any]
    getitems: Callable[[Sequence[int]], list[Any]] | None
    prefetch: Callable[[Sequence[int]], None] | None
    locate: Callable[[int], str] | None
    #: raises if the source's files changed since it was opened (a pass start)
    check_unchanged: Callable[[], None] | None
    read_columns: Callable[[Sequence[int]], dict[str, Any]] | None
    #: the source's columns equal ``default_collate``'s output (automatic columnar)
    columnar_exact: bool
    shard_sizes: Sequence[int] | None
    fingerprint: str | None
    planned: PlannedSource | None
    preferred_shuffle: str
    #: mode -> a warning about that shuffle for this source, or None
    shuffle_advice: Callable[[str], str | None] | None
    #: field -> tokens per document (packing's lengths), or None
    token_lengths: Callable[[str], Any] | None = None
    #: (indices, field) -> each document's token ids, or None
    read_tokens: Callable[[Sequence[int], str], list[Any]] | None = None
    #: (indices, field) -> the documents' ranges in one token window, or None
    token_ranges: Callable[[Any, str], Any] | None = None
    #: the source's cumulative I/O counters in this process (``loader.stats()``): a
    #: mapping with any of ``bytes_read``, ``bytes_decoded``, ``decode_seconds``,
    #: ``cache_hits``, ``cache_misses``
    io_stats: Callable[[], Mapping[str, float]] | None = None
    #: several batches' columns in one read (``GroupedColumnarSource``), or None
    read_column_batches: Callable[[Sequence[Any]], list[dict[str, Any]]] | None = None
    #: the key of the source's content on this machine (``ContentKeyedSource``), or None
    content_key: Callable[[], str] | None = None
    #: ``(shuffle mode, readers)`` before a pass is read where it is read, so the source
    #: can choose how to fetch (remote tar under the global shuffle: by range), or None
    prepare_pass: Callable[[str, int], None] | None = None
    #: the cache directory the source was given (``cache_dir=``), where packing keeps
    #: the documents' lengths and the epochs' plans; None: the default one
    cache_dir: str | None = None

    @classmethod
    def of(cls, source: Any) -> SourceView:
        """Find what ``source`` offers (it must have ``__len__`` and ``__getitem__``)."""
        if not (hasattr(source, "__len__") and hasattr(source, "__getitem__")):
            raise TypeError(
                f"evenly.Dataset needs a source with __len__ and __getitem__, got "
                f"{type(source).__name__}; wrap a generator in a list, or write its "
                f"samples to shards with evenly.write()"
            )
        fingerprint = getattr(source, "fingerprint", None)
        planned = source if isinstance(source, PlannedSource) else None
        return cls(
            source=source,
            read_one=source.__getitem__ if planned is None else planned.read_one,
            getitems=getattr(source, "__getitems__", None)
            if planned is None
            else planned.read_many,
            prefetch=source.prefetch if isinstance(source, PrefetchingSource) else None,
            locate=source.locate if isinstance(source, LocatingSource) else None,
            check_unchanged=source.check_unchanged if isinstance(source, CheckedSource) else None,
            read_columns=source.read_columns if isinstance(source, ColumnarSource) else None,
            columnar_exact=bool(getattr(source, "columnar_exact", False)),
            shard_sizes=getattr(source, "shard_sizes", None),
            fingerprint=fingerprint if isinstance(fingerprint, str) else None,
            planned=planned,
            preferred_shuffle=str(getattr(source, "preferred_shuffle", "global")),
            shuffle_advice=getattr(source, "shuffle_advice", None),
            token_lengths=source.token_lengths if isinstance(source, TokenLengthsSource) else None,
            read_tokens=source.read_tokens if isinstance(source, TokenReadingSource) else None,
            token_ranges=source.token_ranges if isinstance(source, TokenRangesSource) else None,
            io_stats=io_stats if callable(io_stats := getattr(source, "io_stats", None)) else None,
            read_column_batches=source.read_column_batches
            if isinstance(source, GroupedColumnarSource)
            else None,
            content_key=key if callable(key := getattr(source, "content_key", None)) else None,
            prepare_pass=ready
            if callable(ready := getattr(source, "prepare_pass", None))
            else None,
            cache_dir=given
            if isinstance(given := getattr(source, "cache_dir", None), str)
            else None,
        )
