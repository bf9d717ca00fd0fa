"""Packed rows (``pack=``): the reader strategy whose units are rows of ``seq_len``
tokens, and the reads of a worker's rows of a pass.

For a batch of rows the worker looks up their pieces (the epoch's plan, memory-mapped),
reads each document they touch once, runs the per-document transform under the
document's own seeds (a function of seed, epoch and the document's position in the
epoch's order, so a document split over two rows, in two workers, is the same in both),
checks its token count against the planned length and its token ids (non-negative,
below ``Packing.vocab_size`` when known, never ``pad_id``), and assembles the rows.
Rows past the epoch's last one are pad rows.

Where the source offers ``token_ranges`` (local Arrow files, see
:class:`evenly.sources._tokens.TokenSpan`), a group's documents are located with one
fancy index, checked against their planned lengths in one comparison, and their pieces'
tokens gathered with one more: no Python per document or per piece.  Anything else
reads documents one by one.  Either way, every token id a read gives is checked once,
vectorised (:func:`check_tokens`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from functools import partial
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from torch.utils.data import default_collate

from evenly.core.packing.cached import BlockOrder
from evenly.core.packing.pieces import (
    IGNORE,
    Empty,
    RowTable,
    distinct,
    piece_tokens,
    place,
)
from evenly.core.packing.settings import Packing
from evenly.core.permutation import sample_seeds
from evenly.core.plan import EpochPlan, Order
from evenly.core.source import SourceView
from evenly.core.spec import PassSpec
from evenly.core.state import PassState
from evenly.core.stream import StreamPlan
from evenly.errors import StateError
from evenly.runtime.clock import perf_counter
from evenly.runtime.lengths import document_lengths, document_text, document_tokens, tokenized
from evenly.runtime.packed_plans import PlanFiles
from evenly.runtime.reader import ReadContext
from evenly.runtime.rowtap import RowPieces, tap_part
from evenly.runtime.seeds import RngState, SeedSpreader
from evenly.runtime.strategy import Plans, ReadStrategy, planned_reweighted
from evenly.transport.pool import BufferPool
from evenly.transport.slots import plain_collate

__all__ = [
    "PackedRows",
    "StoredDtype",
    "check_lengths",
    "check_tokens",
    "collate_arrays",
    "direct_tokens",
    "documents",
    "packed_items",
    "read_packed",
    "stored_dtype",
]

I64 = npt.NDArray[np.int64]
Row = dict[str, torch.Tensor]
#: a batch of packed rows: ``[rows, seq_len]`` int64 arrays by name
Arrays = dict[str, I64]
#: epoch -> (its rows, its document order)
EpochRows = Callable[[int], tuple[RowTable, Order | None]]
#: position in the epoch -> the dtype its document's ids were stored in (None: unknown)
StoredDtype = Callable[[int], "np.dtype[Any] | None"]
#: Rows read together (whole batches, about this many bytes of ``input_ids``,
#: ``position_ids`` and ``labels``): the per-read Python, and with reader threads each
#: hand-off of the GIL, is paid once per group.
GROUP_BYTES = 16 << 20


def group_batches(seq_len: int, batch: int) -> int:
    """Batches of ``batch`` rows read together (at least one)."""
    return max(1, GROUP_BYTES // max(1, batch * seq_len * 8 * 3))


class PackedRows:
    """The units are rows of ``seq_len`` tokens packed from the source's documents (their
    lengths found once, each epoch's rows planned once per node); a pass yields rows."""

    columnar = False

    def __init__(self, packing: Packing) -> None:
        self.packing = packing
        self._files: PlanFiles | None = None
        self._pools: dict[str, BufferPool] = {}  # the batches' memory, by array
        #: the document orders of the epochs being read (a stream: two), by epoch
        self._orders: dict[tuple[Any, ...], BlockOrder | None] = {}

    def empty(self, name: str, size: int) -> I64:
        """An int64 array of ``size`` for ``name`` from its recycled buffers (``Empty``)."""
        pool = self._pools.get(name)
        if pool is None:
            pool = self._pools.setdefault(name, BufferPool())
        return pool.empty((size,), np.int64)

    def files(self, view: SourceView) -> PlanFiles:
        """The documents' lengths and the epochs' plan files (found once)."""
        if self._files is None:
            lengths, key = document_lengths(view, self.packing, view.cache_dir)
            self._files = PlanFiles(self.packing, lengths, key, cache_dir=view.cache_dir)
        return self._files

    def epoch_rows(
        self, plans: Plans, epoch: int, part: Any = None
    ) -> tuple[RowTable, Order | None]:
        """Epoch ``epoch``'s packed rows and its document order (``part``: what the pass
        carries, for a token mixture's weight changes)."""
        n = plans.num_samples()
        key = (plans.seed, plans.shuffle_mode, plans.block_shards)
        cached = self._orders.get((epoch, n, key))
        if cached is None:
            order = plans.order_for(epoch, n, 1, 0)
            cached = None if order is None else BlockOrder(order, n)
            kept = list(self._orders.items())[-1:]  # the epochs being read (a stream: two)
            self._orders = {**dict(kept), (epoch, n, key): cached}
        return self.files(plans.view).table(epoch, key, cached), cached

    # ---- the reader strategy -----------------------------------------------------
    def for_pass(self, columnar: bool) -> ReadStrategy:
        return self  # rows are assembled from pieces: never read as columns

    def units(self, plans: Plans, epoch: int) -> int:
        """Epoch ``epoch``'s rows (the same every epoch under ``concat``; under
        ``best_fit`` it may differ)."""
        if self.packing.strategy == "concat":
            return self.files(plans.view).concat_rows()  # the epoch's tokens cut into rows
        return self.epoch_rows(plans, epoch)[0].num_rows

    def varied_epochs(self) -> bool:
        return self.packing.strategy == "best_fit"

    def plan(self, plans: Plans, spec: PassSpec) -> EpochPlan:
        """Rows are the unit; the tail is pad rows; the rows are packed from the document
        order already (the plan has none)."""
        return EpochPlan(
            num_samples=self.units(plans, spec.epoch),
            world_size=spec.world_size,
            batch_size=spec.batch_size,
            drop_last=spec.drop_last,
            seed=plans.seed,
            epoch=spec.epoch,
            start=spec.start,
            pad="full" if plans.pad == "repeat" else plans.pad,
            order=None,
        )

    def stream_plan(self, plans: Plans, spec: PassSpec) -> StreamPlan:
        varied = self.varied_epochs()  # then spec.start counts from epoch spec.epoch
        return StreamPlan(
            num_samples=self.units(plans, spec.epoch if varied else 0),
            world_size=spec.world_size,
            batch_size=spec.batch_size,
            seed=plans.seed,
            start=spec.start,
            orders=_no_order,
            lengths=partial(self.units, plans) if varied else None,
            first_epoch=spec.epoch if varied else 0,
        )

    def fingerprint(self) -> dict[str, Any]:
        return self.packing.fingerprint()

    def check_state(self, plans: Plans, state: PassState) -> None:
        rows = self.units(plans, state.epoch)
        if state.position > rows:
            raise StateError(
                f"state['position']={state.position} is past the end of epoch "
                f"{state.epoch} ({rows} packed rows)"
            )

    def check_transform(self, transform: Callable[[Any], Any] | None) -> None:
        return None

    def check_stream(self, plans: Plans) -> None:
        return None  # packing refuses a source that plans its own epochs by samples

    def reweighted(
        self,
        plans: Plans,
        source_state: dict[str, Any],
        state: PassState,
        weights: Mapping[str, float],
    ) -> dict[str, Any]:
        return planned_reweighted(plans, source_state, weights)

    def read(
        self,
        ctx: ReadContext,
        plans: Plans,
        spec: PassSpec,
        skip: int,
        collate: Callable[[list[Any]], Any] | None,
    ) -> Iterator[Any]:
        rows_of = partial(self.epoch_rows, plans, part=spec.source)
        return packed_items(ctx, self, rows_of, skip, collate)

    def readers(self, num_workers: int) -> int:
        """One: a packed read is mostly Python and small numpy steps that hold the GIL,
        so a second thread only contends for it (on 2 cores one thread gave 1.4x two
        threads' tokens/s).  The batches, their order and the checkpoints do not depend
        on how many read them."""
        return 1

    def ahead(self, batch_size: int) -> int:
        return group_batches(self.packing.seq_len, batch_size)

    def releases_gil(self, plans: Plans) -> bool:
        """Reads that are token gathers (a source that reads token ids, no transform, no
        tokenizer): numpy and memory-map copies that need no process each."""
        return (
            self.packing.tokenize is None
            and plans.transform is None
            and plans.view.read_tokens is not None
        )

    # ---- reading -----------------------------------------------------------------
    def tokens(
        self,
        ctx: ReadContext,
        files: PlanFiles,
        epoch: int,
        order: Order | None,
        where: I64,
        index: I64,
        pieces: npt.NDArray[np.void],
        inverse: I64,
        spreader: SeedSpreader | None,
        alloc: Empty,
    ) -> tuple[I64, StoredDtype, Any]:
        """The tokens of every piece, one after the other (the documents at epoch
        positions ``where``, source ``index``, each piece's document ``inverse``), the
        dtype each was stored in, and where each piece's document starts in the source's
        document (0: pieces of whole documents)."""
        planned = files.lengths[index]
        found = direct_tokens(
            ctx, self.packing, planned, epoch, where, index, pieces, inverse, alloc
        )
        if found is not None:
            flat, dtype = found
            return flat, _one_dtype(dtype), 0
        tokens = documents(ctx, self.packing, files, epoch, where, index, spreader)
        return piece_tokens(pieces, tokens, alloc), stored_dtype(tokens), 0

    def __getstate__(self) -> dict[str, Any]:
        """A worker maps the node's files again (a memory map is not pickled) and
        starts with empty buffer pools (a spawned worker would get copies of them)."""
        state = self.__dict__.copy()
        state["_pools"] = {}
        files = state["_files"]
        if files is not None and isinstance(files.lengths, np.memmap):
            state["_files"] = None
        elif files is not None:
            state["_files"] = PlanFiles(
                files.packing, files.lengths, files.lengths_key, files.total, files.cache_dir
            )
        return state


def _no_order(epoch: int) -> Order | None:
    return None


def _pad_rows(packing: Packing, count: int) -> Arrays:
    """``count`` pad rows: all ``pad_id``, position_ids 0, labels -100 (document_ids 0)."""
    shape = (count, packing.seq_len)
    out = {
        "input_ids": np.full(shape, packing.pad_id, dtype=np.int64),
        "position_ids": np.zeros(shape, dtype=np.int64),
        "labels": np.full(shape, IGNORE, dtype=np.int64),
    }
    if packing.document_ids:
        out["document_ids"] = np.zeros(shape, dtype=np.int64)
    return out


def read_packed(
    ctx: ReadContext, packer: PackedRows, epoch_rows: EpochRows, skip: int
) -> Iterator[Arrays]:
    """This worker's batches of packed rows, in order, from its row ``skip`` on: one
    dict of ``[rows, seq_len]`` int64 arrays per plan batch."""
    plan, clock = ctx.plan, ctx.clock
    first, drop = divmod(skip, plan.batch_size)
    spreader = SeedSpreader(ctx.generators) if ctx.transform is not None else None
    files = packer.files(ctx.view)
    chunks = plan.iter_worker_chunks(ctx.rank, ctx.num_workers, ctx.worker_id, first=first)
    watched = ctx.rows_tap is not None  # the audit: one batch per read, with its pieces
    most = 1 if watched else group_batches(packer.packing.seq_len, plan.batch_size)
    reads = 1  # batches per read: 1 at first (the first batch comes at once), then doubled
    for positions, length in chunks:
        lo = 0
        while lo < positions.size:
            step, reads = min(reads, most) * length, min(2 * reads, most)
            seen: list[tuple[I64, ...]] | None = [] if watched else None
            wanted = positions[lo : lo + step]
            lo += step
            group = _rows(ctx, packer, files, epoch_rows, wanted, spreader, seen)
            for at in range(0, group["input_ids"].shape[0], length):
                arrays = {k: v[at + drop : at + length] for k, v in group.items()}
                if seen is not None:
                    ctx.tapped = RowPieces.join(seen, group["input_ids"].shape[0]).tail(drop)
                count, drop = arrays["input_ids"].shape[0], 0
                ctx.progress[0] += count
                clock.samples += count
                yield arrays


def packed_items(
    ctx: ReadContext,
    packer: PackedRows,
    epoch_rows: EpochRows,
    skip: int,
    collate: Callable[[list[Row]], Any] | None,
) -> Iterator[Any]:
    """What a packed pass yields: batches of the default collate (``collate`` is
    torch's or evenly's default: the arrays as tensors, built in the worker, no
    ``torch.stack``), ``collate(rows)`` for the user's own, or single rows (``None``)."""
    batches = read_packed(ctx, packer, epoch_rows, skip)
    if collate in (default_collate, plain_collate) and ctx.rows_tap is None:
        for arrays in batches:
            yield collate_arrays(packer.packing, arrays)
        return
    for arrays in batches:
        tensors = {k: torch.from_numpy(v) for k, v in arrays.items()}
        rows: list[Any] = [
            {k: v[b] for k, v in tensors.items()} for b in range(len(tensors["input_ids"]))
        ]
        if ctx.rows_tap is not None and ctx.tapped is not None:  # the audit's view of them
            rows = ctx.rows_tap(rows, ctx.tapped)
        if collate is None:
            yield from rows
        else:
            started = perf_counter()
            collated = collate(rows)
            ctx.clock.collate += perf_counter() - started
            yield collated


def _rows(
    ctx: ReadContext,
    packer: PackedRows,
    files: PlanFiles,
    epoch_rows: EpochRows,
    positions: I64,
    spreader: SeedSpreader | None,
    seen: list[tuple[I64, ...]] | None = None,
) -> Arrays:
    """The ``[len(positions), seq_len]`` arrays of the rows at ``positions``, in their
    order (a position past its epoch's rows is a pad row): per epoch one read of the
    documents its rows touch and one gather of their pieces' tokens."""
    plan, packing, alloc = ctx.plan, packer.packing, packer.empty
    if isinstance(plan, StreamPlan):
        epochs, rows = plan.split(positions)
        groups = distinct(epochs)[0].tolist()
    else:
        epochs, rows, groups = None, positions, [plan.epoch]
    parts: list[tuple[I64, I64, Arrays]] = []  # (batch slots, slots in arrays, arrays)
    for epoch in groups:
        sel = np.arange(positions.size) if epochs is None else np.flatnonzero(epochs == epoch)
        table, order = epoch_rows(int(epoch))
        mine = rows[sel]
        real = mine < table.num_rows
        wanted = distinct(mine[real])[0]
        if not wanted.size:
            if seen is not None:
                seen.append(tap_part(int(epoch), sel, mine, table.num_rows, None))
            continue
        started = perf_counter()
        pieces = table.pieces(wanted)
        where, inverse = distinct(pieces["pos"])
        index = where if order is None else np.asarray(order(where), dtype=np.int64)
        # base: where the document at a position starts in its real document
        flat, stored, base = packer.tokens(
            ctx, files, int(epoch), order, where, index, pieces, inverse, spreader, alloc
        )
        if seen is not None:  # the audit: the one place a piece's absolute start is made
            first = pieces["start"].astype(np.int64) + base
            seen.append(
                tap_part(int(epoch), sel, mine, table.num_rows, (pieces, where, index, first))
            )
        check_tokens(ctx, packing, flat, pieces, (index, inverse), int(epoch), stored, base)
        doc_index = index[inverse] if packing.document_ids else None
        arrays = place(
            wanted,
            pieces,
            flat,
            seq_len=packing.seq_len,
            pad_id=packing.pad_id,
            doc_index=doc_index,
            empty=alloc,
        )
        if sel.size == positions.size and np.array_equal(wanted, mine):
            ctx.clock.collate += perf_counter() - started
            return arrays  # the common case: a batch of consecutive rows of one epoch
        parts.append((sel[real], np.searchsorted(wanted, mine[real]), arrays))
        ctx.clock.collate += perf_counter() - started
    out = _pad_rows(packing, positions.size)
    for slots, at, arrays in parts:
        for key, array in out.items():
            array[slots] = arrays[key][at]
    return out


def stored_dtype(tokens: Mapping[int, npt.NDArray[Any]]) -> StoredDtype:
    """The dtype a document was read in, by its position (for an error message)."""

    def stored(pos: int) -> np.dtype[Any] | None:
        found = tokens.get(pos)
        return None if found is None else found.dtype

    return stored


def _one_dtype(dtype: np.dtype[Any]) -> StoredDtype:
    """Every document's dtype: ``dtype`` (documents read through a token window)."""
    return lambda pos: dtype


def documents(
    ctx: ReadContext,
    packing: Packing,
    files: PlanFiles,
    epoch: int,
    positions: I64,
    index: I64,
    spreader: SeedSpreader | None,
) -> dict[int, npt.NDArray[np.integer]]:
    """The tokens of the documents at ``positions`` (source ``index``) of ``epoch``,
    each checked against its planned length."""
    view = ctx.view
    wanted = index.tolist()
    # a source that reads token ids directly (no transform, no tokenizer): no row dicts
    direct = view.read_tokens is not None and spreader is None and packing.tokenize is None
    started = perf_counter()
    try:
        if direct:
            assert view.read_tokens is not None
            samples = list(view.read_tokens(wanted, packing.field))
        elif view.getitems is not None:
            samples = list(view.getitems(wanted))
        else:
            samples = [view.read_one(i) for i in wanted]
    except Exception as exc:
        ctx.note(exc, f"documents {wanted[:8]}{'...' if len(wanted) > 8 else ''}")
        raise
    ctx.clock.read += perf_counter() - started
    if spreader is not None:
        samples = _transformed(ctx, spreader, samples, epoch, positions, wanted)
    if packing.tokenize is not None:
        texts = [document_text(s, packing, i) for s, i in zip(samples, wanted, strict=True)]
        ids = tokenized(packing.tokenize, texts, wanted[0])
        try:
            arrays = [np.asarray(t, dtype=np.int64) for t in ids]
        except OverflowError:
            raise _overflow(ctx, ids, wanted, positions, epoch) from None
    else:
        arrays = [
            s
            if type(s) is np.ndarray and s.ndim == 1 and s.dtype.kind in "iu"  # no copy
            else document_tokens(s, packing, i)
            for s, i in zip(samples, wanted, strict=True)
        ]
    planned = files.lengths[index]
    sizes = np.fromiter((a.size for a in arrays), dtype=np.int64, count=len(arrays))
    check_lengths(sizes, planned, wanted, positions, epoch)  # one vectorised check
    return dict(zip(positions.tolist(), arrays, strict=True))


def _overflow(
    ctx: ReadContext, ids: list[list[int]], wanted: list[int], positions: I64, epoch: int
) -> ValueError:
    """The error for a tokenizer's id outside int64's range, naming the first document
    that holds one."""
    for j, tokens in enumerate(ids):
        big = [t for t in tokens if not -(2**63) <= t < 2**63]
        if big:
            doc = wanted[j]
            return ValueError(
                f"evenly: packing: Packing(tokenize=...) gave document {doc} (position "
                f"{int(positions[j])} of epoch {epoch}) of the {type(ctx.source).__name__}"
                f"{ctx.locate(doc)}, the token id {big[0]}, outside int64's range (an "
                f"unsigned id of 2^63 or more): rows are int64; fix the tokenizer"
            )
    return ValueError("evenly: packing: Packing(tokenize=...) gave an id outside int64's range")


def _transformed(
    ctx: ReadContext,
    spreader: SeedSpreader,
    samples: list[Any],
    epoch: int,
    positions: I64,
    index: list[int],
) -> list[Any]:
    """The per-document transform, each document under its own seeds."""
    transform = ctx.transform
    assert transform is not None
    spreader.prepare(sample_seeds(ctx.plan.seed, epoch, positions))
    saved = RngState(ctx.generators)
    out = []
    try:
        for i, sample in enumerate(samples):
            try:
                result = spreader.call(i, transform, sample, False)
            except Exception as exc:
                ctx.note(exc, f"document {index[i]} (position {int(positions[i])})", index[i])
                raise
            out.append(result)
    finally:
        saved.restore()
    return out


def collate_arrays(packing: Packing, arrays: Arrays) -> dict[str, Any]:
    """The default collate of packed rows, from a batch's ``[B, seq_len]`` arrays:
    tensors over them (no copy) and, on request, ``cu_seqlens`` (int32 starts of every
    segment of the flattened batch, a segment beginning wherever ``position_ids == 0``,
    and the end) with ``max_seqlen``."""
    batch: dict[str, Any] = {k: torch.from_numpy(v) for k, v in arrays.items()}
    if packing.cu_seqlens:
        flat = arrays["position_ids"].reshape(-1)
        cu = np.append(np.flatnonzero(flat == 0), flat.size).astype(np.int32)
        batch["cu_seqlens"] = torch.from_numpy(cu)
        batch["max_seqlen"] = int(np.diff(cu).max()) if cu.size > 1 else 0
    return batch


def check_tokens(
    ctx: ReadContext,
    packing: Packing,
    flat: I64,
    pieces: npt.NDArray[np.void],
    docs: tuple[I64, I64],
    epoch: int,
    stored: StoredDtype,
    base: Any = 0,
) -> None:
    """Raise, naming the first document at fault, if a token id of a read is negative
    (-100 among them: the loss's ignore index), not below ``Packing.vocab_size`` (when
    known), or ``pad_id``.  ``flat``: the read's pieces' tokens, one after the other
    (every token of the epoch is in one piece, so each is checked once); ``docs``: the
    source index of each distinct position, and each piece's; ``stored``: the dtype a
    position's document was stored in (an unsigned id of 2^63 or more reads as negative);
    ``base``: where each piece's document starts in the source's document (a token
    mixture's pieces of documents), for the offset named.

    Vectorised, two passes per read: the maximum of the ids read as unsigned (a negative
    id is then 2^63 or more, so one reduction bounds both ends) and the search for
    ``pad_id`` the check had before."""
    if not flat.size:
        return
    vocab, pad_id = packing.vocab_size, packing.pad_id
    limit = 2**63 if vocab is None else vocab
    unsigned = np.ascontiguousarray(flat).view(np.uint64)
    if int(unsigned.max()) < limit and not bool((flat == pad_id).any()):
        return
    bad = (flat < 0) | (flat == pad_id)
    if vocab is not None:
        bad |= flat >= vocab
    at = int(np.argmax(bad))
    ends = np.cumsum(pieces["len"].astype(np.int64))
    k = int(np.searchsorted(ends, at, side="right"))
    offset = int(pieces["start"][k]) + at - (int(ends[k]) - int(pieces["len"][k]))
    offset += int(np.broadcast_to(base, pieces.shape)[k])
    doc, pos = int(docs[0][docs[1][k]]), int(pieces["pos"][k])
    where = (
        f"document {doc} (position {pos} of epoch {epoch}) of the "
        f"{type(ctx.source).__name__}{ctx.locate(doc)},"
    )
    raise ValueError(_why(where, int(flat[at]), offset, packing, stored(pos)))


def _why(where: str, value: int, offset: int, packing: Packing, stored: Any) -> str:
    """The message for token id ``value`` at token ``offset`` of a document."""
    head = f"evenly: packing: {where}"
    fix = "fix the tokenizer or the pre-tokenized data (or leave the document out)"
    if value == packing.pad_id:
        return (
            f"{head} uses the pad token pad_id={value} (at token {offset}): pads would be "
            f"indistinguishable from its tokens; choose a pad_id no document uses "
            f"(Packing(pad_id=...), e.g. the tokenizer's pad id)"
        )
    if value < 0 and (stored == np.dtype(np.uint64) or value <= -(2**62)):
        how = ", stored as uint64" if stored is not None else ""
        return (
            f"{head} holds the unsigned token id {value + 2**64} (at token {offset}{how}), "
            f"above int64's range (2^63 - 1): rows are int64, where it would read as "
            f"{value}; {fix}"
        )
    if value == IGNORE:
        return (
            f"{head} holds token id -100 (at token {offset}): the loss's ignore index, so "
            f"its label would silently mask the token, and no vocabulary has it; token ids "
            f"are non-negative: {fix}"
        )
    if value < 0:
        return (
            f"{head} holds the negative token id {value} (at token {offset}): token ids "
            f"are non-negative (an embedding has no row for it); {fix}"
        )
    vocab = packing.vocab_size
    whose = " (the tokenizer's)" if getattr(packing.tokenize, "vocab_size", None) == vocab else ""
    return (
        f"{head} holds token id {value} (at token {offset}), not below "
        f"Packing(vocab_size={vocab}){whose}: the model's embedding has no row for it; "
        f"{fix}, or set Packing(vocab_size=...) to the model's vocabulary size"
    )


def check_lengths(
    sizes: I64, planned: I64, documents: list[int] | I64, positions: I64, epoch: int
) -> None:
    """Raise, naming the first document at fault, if a document's token count is not the
    one its lengths pass found."""
    if np.array_equal(sizes, planned):
        return
    bad = int(np.flatnonzero(sizes != planned)[0])
    raise ValueError(
        f"evenly: packing: document {int(documents[bad])} (position {int(positions[bad])} of "
        f"epoch {epoch}) holds {int(sizes[bad])} tokens, but {int(planned[bad])} when "
        f"its lengths were computed: the transform must keep each document's token "
        f"count (or the source changed since; its cached lengths are in cache_dir/lengths)"
    )


def direct_tokens(
    ctx: ReadContext,
    packing: Packing,
    planned: I64,
    epoch: int,
    where: I64,
    index: I64,
    pieces: npt.NDArray[np.void],
    inverse: I64,
    empty: Empty,
) -> tuple[I64, np.dtype[Any]] | None:
    """The tokens of every piece, one after the other (int64; what ``piece_tokens`` gives
    from documents read one by one), read through the source's token window, and the
    dtype they are stored in; None where the source has none.  ``where``/``index``: each
    distinct document's epoch position and source index; ``planned``: their planned
    lengths; ``inverse``: each piece's document; ``empty``: where the tokens go."""
    ranges = ctx.view.token_ranges
    if ranges is None or packing.tokenize is not None or ctx.transform is not None:
        return None
    started = perf_counter()
    try:
        found = ranges(index, packing.field)
    except Exception as exc:
        first = index[:8].tolist()
        ctx.note(exc, f"documents {first}{'...' if index.size > 8 else ''}")
        raise
    if found is None:
        return None
    span, starts, lengths = found
    check_lengths(lengths, planned, index, where, epoch)
    lengths = pieces["len"].astype(np.int64)
    out = empty("flat", int(lengths.sum()))
    tokens: I64 = span.gather(starts[inverse] + pieces["start"], lengths, out)
    ctx.clock.read += perf_counter() - started
    return tokens, span.values.dtype
