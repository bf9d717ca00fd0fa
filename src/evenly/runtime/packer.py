"""Reading packed rows: a worker's rows of a pass, built from the documents they hold.

For a batch of rows the worker looks up their pieces (the epoch's plan, memory-mapped),
reads each document they touch once, runs the per-document transform under the
document's own seeds (a function of seed, epoch and the document's position in the
epoch's order, so a document split over two rows, in two workers, is the same in both),
checks its token count against the planned length and that it does not use ``pad_id``,
and assembles the rows.  Rows past the epoch's last one are pad rows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from evenly.core.packing.pieces import IGNORE, RowTable, assemble
from evenly.core.packing.settings import Packing
from evenly.core.permutation import sample_seeds
from evenly.core.plan import Order
from evenly.core.source import SourceView
from evenly.core.stream import StreamPlan
from evenly.runtime.lengths import document_lengths, document_text, document_tokens, tokenized
from evenly.runtime.packed_plans import PlanFiles
from evenly.runtime.reader import ReadContext
from evenly.runtime.rowtap import RowPieces, tap_part
from evenly.runtime.seeds import RngState, SeedSpreader

__all__ = ["Packer", "collate_rows", "read_packed"]

I64 = npt.NDArray[np.int64]
Row = dict[str, torch.Tensor]
#: epoch -> (its rows, its document order)
EpochRows = Callable[[int], tuple[RowTable, Order | None]]


class Packer:
    """Packing for one dataset: the documents' lengths (found once) and the epochs' rows."""

    def __init__(self, packing: Packing) -> None:
        self.packing = packing
        self._files: PlanFiles | None = None

    @classmethod
    def build(
        cls, pack: Packing | None, view: SourceView, on_error: str, pad: str
    ) -> Packer | None:
        """The packer of ``pack=``, or ``None``; what packing cannot do is refused here."""
        if pack is None:
            return None
        if not isinstance(pack, Packing):
            raise TypeError(f"pack must be an evenly.Packing, got {type(pack).__name__}")
        if view.planned is not None:
            raise NotImplementedError(
                f"evenly.Dataset(pack=...) over a {type(view.source).__name__} is not "
                f"supported yet: a Mix with packing apportions its sources by tokens "
                f"(evenly.Mix(..., unit='tokens')), which is coming; pack each source alone"
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

    def check_stream(self) -> None:
        """Refuse what training by steps (``infinite=True``) cannot do yet."""
        if self.packing.strategy == "best_fit":
            raise ValueError(
                "evenly.DataLoader(infinite=True) with Packing(strategy='best_fit') is not "
                "supported yet: its row count differs between epochs, which a stream of "
                "epochs would have to plan ahead; use strategy='concat' to train by steps"
            )

    def reset(self) -> None:
        """The source was replaced: find its lengths again."""
        self._files = None

    def files(self, view: SourceView) -> PlanFiles:
        if self._files is None:
            lengths, key = document_lengths(view, self.packing)
            self._files = PlanFiles(self.packing, lengths, key)
        return self._files

    def __getstate__(self) -> dict[str, Any]:
        """A worker maps the node's files again (a memory map is not pickled)."""
        state = self.__dict__.copy()
        files = state["_files"]
        if files is not None and isinstance(files.lengths, np.memmap):
            state["_files"] = None
        elif files is not None:
            state["_files"] = PlanFiles(files.packing, files.lengths, files.lengths_key)
        return state


def _pad_row(packing: Packing) -> Row:
    n = packing.seq_len
    row = {
        "input_ids": torch.full((n,), packing.pad_id, dtype=torch.int64),
        "position_ids": torch.zeros(n, dtype=torch.int64),
        "labels": torch.full((n,), IGNORE, dtype=torch.int64),
    }
    if packing.document_ids:
        row["document_ids"] = torch.zeros(n, dtype=torch.int64)
    return row


def read_packed(
    ctx: ReadContext, packer: Packer, epoch_rows: EpochRows, skip: int
) -> Iterator[list[Row]]:
    """This worker's batches of packed rows, in order, from its row ``skip`` on."""
    plan = ctx.plan
    first, drop = divmod(skip, plan.batch_size)
    spreader = SeedSpreader(ctx.generators) if ctx.transform is not None else None
    files = packer.files(ctx.view)
    chunks = plan.iter_worker_chunks(ctx.rank, ctx.num_workers, ctx.worker_id, first=first)
    for positions, length in chunks:
        for lo in range(0, positions.size, length):
            rows = _rows(
                ctx, packer.packing, files, epoch_rows, positions[lo : lo + length], spreader
            )
            if drop:
                rows, drop = rows[drop:], 0
            ctx.progress[0] += len(rows)
            yield rows


def _rows(
    ctx: ReadContext,
    packing: Packing,
    files: PlanFiles,
    epoch_rows: EpochRows,
    positions: I64,
    spreader: SeedSpreader | None,
) -> list[Row]:
    plan = ctx.plan
    if isinstance(plan, StreamPlan):
        epochs, rows = np.divmod(positions, plan.num_samples)
    else:
        epochs, rows = np.full(positions.size, plan.epoch, dtype=np.int64), positions
    out: list[Row | None] = [None] * positions.size
    tapped: list[tuple[I64, ...]] | None = None if ctx.rows_tap is None else []
    for epoch in np.unique(epochs).tolist():
        sel = np.flatnonzero(epochs == epoch)
        table, order = epoch_rows(int(epoch))
        mine = rows[sel]
        wanted = np.unique(mine[mine < table.num_rows])
        if wanted.size:
            pieces = table.pieces(wanted)
            where = np.unique(pieces["pos"])
            index = where if order is None else np.asarray(order(where), dtype=np.int64)
            tokens = _documents(ctx, packing, files, int(epoch), where, index, spreader)
            arrays = assemble(
                wanted,
                pieces,
                tokens,
                seq_len=packing.seq_len,
                pad_id=packing.pad_id,
                doc_index=dict(zip(where.tolist(), index.tolist(), strict=True)),
            )
            if not packing.document_ids:
                del arrays["document_ids"]
            tensors = {k: torch.from_numpy(v) for k, v in arrays.items()}
        if tapped is not None:  # the audit: the one place a piece's absolute start is made
            base = 0  # where the document at a position starts in its real document
            found = (pieces, where, index, pieces["start"] + base) if wanted.size else None
            tapped.append(tap_part(int(epoch), sel, mine, table.num_rows, found))
        for i, r in zip(sel.tolist(), mine.tolist(), strict=True):
            if r >= table.num_rows:
                out[i] = _pad_row(packing)
            else:
                b = int(np.searchsorted(wanted, r))
                out[i] = {k: v[b] for k, v in tensors.items()}
    done = [row for row in out if row is not None]
    if tapped is None or ctx.rows_tap is None:
        return done
    return ctx.rows_tap(done, RowPieces.join(tapped, len(done)))


def _documents(
    ctx: ReadContext,
    packing: Packing,
    files: PlanFiles,
    epoch: int,
    positions: I64,
    index: I64,
    spreader: SeedSpreader | None,
) -> dict[int, npt.NDArray[np.int64]]:
    """The tokens of the documents at ``positions`` (source ``index``) of ``epoch``."""
    view = ctx.view
    wanted = index.tolist()
    # a source that reads token ids directly (no transform, no tokenizer): no row dicts
    direct = view.read_tokens is not None and spreader is None and packing.tokenize is None
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
    if spreader is not None:
        samples = _transformed(ctx, spreader, samples, epoch, positions, wanted)
    if packing.tokenize is not None:
        texts = [document_text(s, packing, i) for s, i in zip(samples, wanted, strict=True)]
        arrays = [np.asarray(t, dtype=np.int64) for t in tokenized(packing, texts, wanted[0])]
    else:
        arrays = [document_tokens(s, packing, i) for s, i in zip(samples, wanted, strict=True)]
    planned = np.asarray(files.lengths[index], dtype=np.int64).tolist()
    sizes = [a.size for a in arrays]
    clean = sizes == planned and not (
        arrays and bool((np.concatenate(arrays) == packing.pad_id).any())
    )
    if clean:  # one vectorised check for the batch; the loop below names a culprit
        return dict(zip(positions.tolist(), arrays, strict=True))
    out = {}
    for pos, i, tokens, n in zip(positions.tolist(), wanted, arrays, planned, strict=True):
        if tokens.size != n:
            raise ValueError(
                f"evenly: packing: document {i} (position {pos} of epoch {epoch}) holds "
                f"{tokens.size} tokens, but {n} when its lengths were computed: the transform "
                f"must keep each document's token count (or the source changed since; its "
                f"cached lengths are in cache_dir/lengths)"
            )
        hit = np.flatnonzero(tokens == packing.pad_id)
        if hit.size:
            raise ValueError(
                f"evenly: packing: document {i} (position {pos} of epoch {epoch}) uses the pad "
                f"token pad_id={packing.pad_id} (at token {int(hit[0])}): pads would be "
                f"indistinguishable from its tokens; choose a pad_id no document uses "
                f"(Packing(pad_id=...), e.g. the tokenizer's pad id)"
            )
        out[pos] = tokens
    return out


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


def collate_rows(packing: Packing) -> Callable[[list[Row]], dict[str, Any]]:
    """The default collate of packed rows: ``[B, seq_len]`` tensors (and, on request,
    ``cu_seqlens``: int32 starts of every segment of the flattened batch, a segment
    beginning wherever ``position_ids == 0``, with ``max_seqlen``)."""

    def collate(rows: list[Row]) -> dict[str, Any]:
        batch: dict[str, Any] = {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
        if packing.cu_seqlens:
            flat = batch["position_ids"].reshape(-1)
            starts = torch.nonzero(flat == 0).reshape(-1)
            cu = torch.cat([starts, torch.tensor([flat.numel()])]).to(torch.int32)
            batch["cu_seqlens"] = cu
            batch["max_seqlen"] = int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0
        return batch

    return collate
