"""Reading packed rows: a worker's rows of a pass, built from the documents they hold.

For a batch of rows the worker looks up their pieces (the epoch's plan, memory-mapped),
reads each document they touch once, runs the per-document transform under the
document's own seeds (a function of seed, epoch and the document's position in the
epoch's order, so a document split over two rows, in two workers, is the same in both),
checks its token count against the planned length and its token ids (non-negative,
below ``Packing.vocab_size`` when known, never ``pad_id``), and assembles the rows.
Rows past the epoch's last one are pad rows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from torch.utils.data import default_collate

from evenly.core.packing.pieces import (
    IGNORE,
    Empty,
    RowTable,
    distinct,
    fresh,
    piece_tokens,
    place,
)
from evenly.core.packing.settings import Packing
from evenly.core.permutation import sample_seeds
from evenly.core.plan import Order
from evenly.core.source import SourceView
from evenly.core.stream import StreamPlan
from evenly.runtime.clock import perf_counter
from evenly.runtime.lengths import document_lengths, document_text, document_tokens, tokenized
from evenly.runtime.packed_plans import PlanFiles
from evenly.runtime.reader import ReadContext
from evenly.runtime.rowtap import RowPieces, tap_part
from evenly.runtime.seeds import RngState, SeedSpreader
from evenly.runtime.token_mix import TokenItems, is_token_mix, mix_lengths, token_items
from evenly.runtime.token_reads import StoredDtype, check_lengths, check_tokens, direct_tokens
from evenly.transport.pool import BufferPool
from evenly.transport.slots import plain_collate

__all__ = ["Packer", "collate_arrays", "packed_items", "read_packed"]

I64 = npt.NDArray[np.int64]
Row = dict[str, torch.Tensor]
#: a batch of packed rows: ``[rows, seq_len]`` int64 arrays by name
Arrays = dict[str, I64]
#: epoch -> (its rows, its document order)
EpochRows = Callable[[int], tuple[RowTable, Order | None]]
#: Rows read together (whole batches, about this many bytes of ``input_ids``,
#: ``position_ids`` and ``labels``): the per-read Python, and with reader threads each
#: hand-off of the GIL, is paid once per group.
GROUP_BYTES = 16 << 20


def group_batches(seq_len: int, batch: int) -> int:
    """Batches of ``batch`` rows read together (at least one)."""
    return max(1, GROUP_BYTES // max(1, batch * seq_len * 8 * 3))


class Packer:
    """Packing for one dataset: the documents' lengths (found once) and the epochs' rows."""

    def __init__(self, packing: Packing) -> None:
        self.packing = packing
        self._files: PlanFiles | None = None
        self._items: dict[tuple[Any, ...], TokenItems] = {}
        self._pools: dict[str, BufferPool] = {}  # the batches' memory, by array

    def empty(self, name: str, size: int) -> I64:
        """An int64 array of ``size`` for ``name`` from its recycled buffers (``Empty``)."""
        pool = self._pools.get(name)
        if pool is None:
            pool = self._pools.setdefault(name, BufferPool())
        return pool.empty((size,), np.int64)

    @classmethod
    def build(
        cls, pack: Packing | None, view: SourceView, on_error: str, pad: str
    ) -> Packer | None:
        """The packer of ``pack=``, or ``None``; what packing cannot do is refused here."""
        if pack is None:
            return None
        if not isinstance(pack, Packing):
            raise TypeError(f"pack must be an evenly.Packing, got {type(pack).__name__}")
        if view.planned is not None and not is_token_mix(view.source):
            raise ValueError(
                f"evenly.Dataset(pack=...) over a {type(view.source).__name__} by samples: "
                f"a Mix with packing apportions its sources by tokens, build it as "
                f"evenly.Mix(..., unit='tokens')"
            )
        if on_error != "raise":
            raise ValueError(
                "on_error='skip' cannot be used with pack=: a document replaced by another "
                "changes the token counts the rows were planned from; use on_error='raise'"
            )
        if pad == "mask":
            raise ValueError(
                "pad='mask' is not used with pack=: the epoch's tail is pad rows, already "
                "marked (labels -100); use the default pad, or pad='none' for evaluation"
            )
        return cls(pack)

    def reset(self) -> None:
        """The source was replaced: find its lengths again."""
        self._files = None
        self._items = {}

    def files(self, view: SourceView) -> PlanFiles:
        if self._files is None:
            if is_token_mix(view.source):
                mixed, key = mix_lengths(view.source, self.packing)
                total = sum(view.source.token_shares(mixed.totals))
                self._files = PlanFiles(self.packing, mixed, key, total)
            else:
                lengths, key = document_lengths(view, self.packing)
                self._files = PlanFiles(self.packing, lengths, key)
        return self._files

    def items(
        self, view: SourceView, seed: int, epoch: int, shuffle: bool, part: Any = None
    ) -> TokenItems:
        """A token mixture's epoch ``epoch``: its pieces of documents, in order."""
        key = (seed, epoch, shuffle, repr(part or None))
        found = self._items.get(key)
        if found is None:
            files = self.files(view)
            found = token_items(
                view.source,
                self.packing,
                files.lengths,
                files.lengths_key,
                seed=seed,
                epoch=epoch,
                shuffle=shuffle,
                part=part,
            )
            if len(self._items) >= 3:
                self._items.pop(next(iter(self._items)))
            self._items[key] = found
        return found

    def __getstate__(self) -> dict[str, Any]:
        """A worker maps the node's files again (a memory map is not pickled) and
        starts with empty buffer pools (a spawned worker would get copies of them)."""
        state = self.__dict__.copy()
        state["_items"] = {}
        state["_pools"] = {}
        files = state["_files"]
        if files is not None and isinstance(files.lengths, np.memmap):
            state["_files"] = None
        elif files is not None:
            state["_files"] = PlanFiles(
                files.packing, files.lengths, files.lengths_key, files.total
            )
        return state


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
    ctx: ReadContext, packer: Packer, epoch_rows: EpochRows, skip: int
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
            group = _rows(
                ctx, packer.packing, files, epoch_rows, wanted, spreader, seen, packer.empty
            )
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
    packer: Packer,
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
    packing: Packing,
    files: PlanFiles,
    epoch_rows: EpochRows,
    positions: I64,
    spreader: SeedSpreader | None,
    seen: list[tuple[I64, ...]] | None = None,
    alloc: Empty = fresh,
) -> Arrays:
    """The ``[len(positions), seq_len]`` arrays of the rows at ``positions``, in their
    order (a position past its epoch's rows is a pad row): per epoch one read of the
    documents its rows touch and one gather of their pieces' tokens."""
    plan = ctx.plan
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
        base: Any = 0  # where the document at a position starts in its real document
        flat = None
        tokens: dict[int, npt.NDArray[np.integer]] = {}
        stored: StoredDtype  # the dtype each document's ids were stored in
        if isinstance(order, TokenItems):  # a token mixture's pieces of documents
            tokens = _documents(ctx, packing, files, int(epoch), where, index, spreader)
            tokens = order.cut(where, tokens)
            base = order.starts(pieces["pos"])
        else:
            planned = files.lengths[index]
            found = direct_tokens(
                ctx, packing, planned, int(epoch), where, index, pieces, inverse, alloc
            )
            if found is None:
                tokens = _documents(ctx, packing, files, int(epoch), where, index, spreader)
            else:
                flat, dtype = found
                stored = _one_dtype(dtype)
        if seen is not None:  # the audit: the one place a piece's absolute start is made
            first = pieces["start"].astype(np.int64) + base
            seen.append(
                tap_part(int(epoch), sel, mine, table.num_rows, (pieces, where, index, first))
            )
        if flat is None:
            flat = piece_tokens(pieces, tokens, alloc)
            stored = _stored_dtype(tokens)
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


def _stored_dtype(tokens: Mapping[int, npt.NDArray[Any]]) -> StoredDtype:
    """The dtype a document was read in, by its position (for an error message)."""

    def stored(pos: int) -> np.dtype[Any] | None:
        found = tokens.get(pos)
        return None if found is None else found.dtype

    return stored


def _one_dtype(dtype: np.dtype[Any]) -> StoredDtype:
    """Every document's dtype: ``dtype`` (documents read through a token window)."""
    return lambda pos: dtype


def _documents(
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
