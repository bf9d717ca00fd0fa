"""The dataset as its loaders see it: one typed object that plans passes, reads them and
turns pass states into checkpoints and back.

``evenly.Dataset`` is the user's view (settings, ``set_epoch``, ``state_dict``, ``len``);
``evenly.DataLoader``, its feed, ``evenly.BatchSampler``'s shared checks and the audit
talk to a dataset only through its :class:`Planner` (``dataset._planner``).  What the
source offers is found once (:class:`~evenly.core.source.SourceView`), when the source is
set, not on each pass.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import get_worker_info

from evenly.core.order import make_order
from evenly.core.packing.cached import BlockOrder
from evenly.core.packing.pieces import RowTable
from evenly.core.packing.settings import Packing
from evenly.core.plan import PAD_MODES, EpochPlan, Order
from evenly.core.source import SourceView
from evenly.core.spec import PassSpec
from evenly.core.state import PassState
from evenly.core.stream import StreamPlan
from evenly.errors import StateError, check_int
from evenly.options import ON_ERROR, Generator, OnError, Pad, Shuffle
from evenly.runtime.checks import check_current, shuffle_mode
from evenly.runtime.clock import StageClock, perf_counter
from evenly.runtime.packer import Packer, packed_items
from evenly.runtime.reader import ReadContext, read_batches
from evenly.runtime.rowtap import RowsTap
from evenly.runtime.seeds import check_generators
from evenly.runtime.token_mix import is_token_mix, token_reweighted

__all__ = ["Planner", "ReadTap"]

logger = logging.getLogger("evenly")

#: Something that sees every sample a pass reads (the audit): called in the process that
#: reads, with the batch's source indices and samples, before they are collated.
ReadTap = Callable[[list[int], list[Any]], list[Any]]


class Planner:
    """Plans, reads and checkpoints the passes of one dataset (its settings live here)."""

    def __init__(
        self,
        source: Any,
        *,
        shuffle: Shuffle,
        seed: int,
        drop_last: bool,
        transform: Callable[[Any], Any] | None,
        seed_generators: tuple[Generator, ...] | list[Generator],
        block_shards: int,
        on_error: OnError,
        pad: Pad = "repeat",
        pack: Packing | None = None,
    ) -> None:
        self.view = SourceView.of(source)
        self.generation = 0
        self.transform = transform
        self.shuffle_mode = shuffle_mode(shuffle, self.view)
        self.block_shards = check_int("block_shards", block_shards, minimum=1)
        if on_error not in ON_ERROR:
            raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
        self.on_error = on_error
        self.seed = check_int("seed", seed)
        self.drop_last = bool(drop_last)
        self.seed_generators = check_generators(seed_generators)
        if pad not in PAD_MODES:
            raise ValueError(f"pad must be one of {list(PAD_MODES)}, got {pad!r}")
        self.pad = pad
        #: packing (``pack=``): rows of tokens are the plan's unit
        self.packer = Packer.build(pack, self.view, on_error, pad)
        self._orders: dict[tuple[Any, ...], BlockOrder | None] = {}
        self._check_mask()
        #: the audit's tap on every read (None: no one is watching)
        self.tap: ReadTap | None = None
        #: under ``pack=``: the audit's tap on every batch of rows, with their pieces
        self.rows_tap: RowsTap | None = None

    # ---- what may change between passes ------------------------------------------
    @property
    def source(self) -> Any:
        return self.view.source

    def replace(self, source: Any = None, transform: Any = None, *, which: str) -> None:
        """Replace the source or the transform: a new generation."""
        if which == "source":
            self.view = SourceView.of(source)
            if self.packer is not None:
                Packer.build(self.packer.packing, self.view, self.on_error, self.pad)
                self.packer.reset()
        else:
            self.transform = transform
            self._check_mask()
        self.generation += 1

    def _check_mask(self) -> None:
        if is_token_mix(self.source) and (self.packer is None or self.transform is not None):
            raise ValueError(
                "an evenly.Mix(unit='tokens') is read packed, with no per-document transform"
                " (its documents are cut into seq_len pieces, each placed on its own): pass "
                "pack=evenly.Packing(seq_len, ...) and no transform"
            )
        if self.pad == "mask" and self.transform is None:
            raise ValueError(
                "pad='mask' needs a transform: it is where each sample learns whether it is "
                "padding (evenly.is_padding()), to mark it (a label of -100, a weight of 0); "
                "pass transform=..., or use pad='repeat' or pad='none'"
            )

    def check_files(self) -> None:
        """Raise if the source's files changed since it was opened (every pass start)."""
        if self.view.check_unchanged is not None:
            self.view.check_unchanged()

    def num_samples(self) -> int:
        return len(self.view.source)

    # ---- packing -----------------------------------------------------------------
    def units(self, epoch: int) -> int:
        """The plan's units in epoch ``epoch``: samples, or under packing that epoch's
        rows (the same every epoch under ``concat``; under ``best_fit`` it may differ)."""
        if self.packer is None:
            return self.num_samples()
        files = self.packer.files(self.view)
        if self.packer.packing.strategy == "concat":
            return files.concat_rows()  # the epoch's tokens cut into rows
        return self.epoch_rows(epoch)[0].num_rows

    def epoch_rows(self, epoch: int, part: Any = None) -> tuple[RowTable, Order | None]:
        """Epoch ``epoch``'s packed rows and its document order (``part``: what the pass
        carries, for a token mixture's weight changes)."""
        assert self.packer is not None
        n = self.num_samples()
        key = (self.seed, self.shuffle_mode, self.block_shards)
        if is_token_mix(self.source):  # the order's positions are pieces of documents
            items = self.packer.items(
                self.view, self.seed, epoch, self.shuffle_mode != "none", part
            )
            return self.packer.files(self.view).table(epoch, key, items, items), items
        cached = self._orders.get((epoch, n, key))
        if cached is None:
            order = self.order_for(epoch, n, 1, 0)
            cached = None if order is None else BlockOrder(order, n)
            kept = list(self._orders.items())[-1:]  # the epochs being read (a stream: two)
            self._orders = {**dict(kept), (epoch, n, key): cached}
        return self.packer.files(self.view).table(epoch, key, cached), cached

    def source_fingerprint(self) -> int:
        """A 63-bit digest of ``source.fingerprint`` (0 if the source has none)."""
        fp = self.view.fingerprint
        if fp is None:
            return 0
        return int.from_bytes(hashlib.blake2b(fp.encode(), digest_size=8).digest(), "little") >> 1

    def main_view(self) -> tuple[int, int, int]:
        """(len, fingerprint, generation) as seen now."""
        return self.num_samples(), self.source_fingerprint(), self.generation

    # ---- plans -------------------------------------------------------------------
    def plan_for(self, spec: PassSpec) -> EpochPlan:
        """The epoch plan a pass spec describes (the one code path that builds plans;
        ``stream_plan_for`` for an infinite pass)."""
        if spec.infinite:
            raise ValueError("an infinite pass has a stream plan: use stream_plan_for")
        packed = self.packer is not None  # rows are the unit; the tail is pad rows
        return EpochPlan(
            num_samples=self.units(spec.epoch) if packed else spec.num_samples,
            world_size=spec.world_size,
            batch_size=spec.batch_size,
            drop_last=spec.drop_last,
            seed=self.seed,
            epoch=spec.epoch,
            start=spec.start,
            pad="full" if packed and self.pad == "repeat" else self.pad,
            order=None
            if packed  # the rows are packed from the document order already
            else self.order_for(
                spec.epoch,
                spec.num_samples,
                spec.world_size * spec.batch_size,
                spec.start,
                spec.source,
            ),
        )

    def stream_plan_for(self, spec: PassSpec) -> StreamPlan:
        """The endless plan over consecutive epochs of an infinite pass (under packing:
        of every epoch's rows, packed from the document order already)."""
        step = spec.world_size * spec.batch_size
        packed = self.packer is not None
        varied = self.varied_epochs()  # then spec.start counts from epoch spec.epoch
        return StreamPlan(
            num_samples=self.units(spec.epoch if varied else 0) if packed else spec.num_samples,
            world_size=spec.world_size,
            batch_size=spec.batch_size,
            seed=self.seed,
            start=spec.start,
            orders=(lambda epoch: None)
            if packed
            else (lambda epoch: self.order_for(epoch, spec.num_samples, step, 0)),
            lengths=self.units if varied else None,
            first_epoch=spec.epoch if varied else 0,
        )

    def pass_start(self, epoch: int, position: int, infinite: bool) -> int:
        """A pass's ``spec.start`` from a state: the position in the epoch, or for a stream
        over epochs of one length, the stream position (else counted from ``epoch``)."""
        flat = infinite and not self.varied_epochs()
        u = self.units(0 if flat else epoch)  # rows under packing
        return (epoch * u if flat else 0) + min(position, u)

    def varied_epochs(self) -> bool:
        """Whether epochs differ in units (packed rows under ``best_fit``)."""
        return self.packer is not None and self.packer.packing.strategy == "best_fit"

    def order_for(
        self, epoch: int, num_samples: int, step: int, start: int, part: Any = None
    ) -> Order | None:
        """Epoch ``epoch``'s order.  A source that plans its own (``evenly.Mix``) gets the
        global step, the pass's start and what the pass carries (``part``); any other is
        ordered by the shuffle mode."""
        planned = self.view.planned
        if planned is not None:
            order: Order = planned.epoch_order(
                self.seed,
                epoch,
                shuffle=self.shuffle_mode != "none",
                step=step,
                start=start,
                part=part,
            )
            return order
        return make_order(
            self.shuffle_mode,
            num_samples,
            seed=self.seed,
            epoch=epoch,
            shard_sizes=self.view.shard_sizes,
            block_shards=self.block_shards,
        )

    # ---- checkpoints -------------------------------------------------------------
    def fingerprint(self, drop_last: bool | None = None) -> dict[str, Any]:
        """What a checkpoint state must agree on: N, seed, shuffle, drop_last (the
        loader's, when a loader owns the passes), source."""
        fp: dict[str, Any] = {
            "num_samples": self.num_samples(),
            "seed": self.seed,
            "shuffle": self.shuffle_mode,
            "drop_last": self.drop_last if drop_last is None else bool(drop_last),
            "pad": self.pad,
        }
        if self.shuffle_mode == "block":
            fp["block_shards"] = self.block_shards
        if self.packer is not None:
            fp.update(self.packer.packing.fingerprint())
        if self.view.fingerprint is not None:
            fp["source"] = self.view.fingerprint
        if self.view.planned is not None:
            # a planned source (a Mix) checks its own state: its length may change at an
            # epoch boundary (new samples_per_epoch)
            del fp["num_samples"]
        return fp

    def to_state(
        self, state: PassState, drop_last: bool | None = None, order: Any = None
    ) -> dict[str, Any]:
        """The checkpoint dict of ``state``; a planned source adds its part, from what
        the pass carries and the ``order`` of the pass that reached the position."""
        planned = self.view.planned
        saved = PassState(state.epoch, state.position, state.batches)
        if planned is not None:
            part = planned.source_state(state.epoch, state.position, state.source, order)
            saved = PassState(state.epoch, state.position, state.batches, part)
        return saved.to_dict(self.fingerprint(drop_last))

    def reweighted(
        self,
        state: PassState,
        weights: Mapping[str, float],
        drop_last: bool | None = None,
        order: Any = None,
    ) -> PassState:
        """``state`` with a planned source's new ``weights`` from its position on (as if
        saved, changed and loaded: the same checks as a checkpoint)."""
        planned = self.view.planned
        if planned is None:
            raise TypeError(
                f"set_weights needs an evenly.Mix source, not {type(self.source).__name__}"
            )
        saved = self.to_state(state, drop_last, order)
        if is_token_mix(self.source) and self.packer is not None:
            files = self.packer.files(self.view)
            saved["source_state"]["part"] = token_reweighted(
                self.source,
                self.packer.packing,
                files.lengths,
                state.source,
                epoch=state.epoch,
                position=state.position,
                weights=weights,
                seed=self.seed,
                shuffle=self.shuffle_mode != "none",
            )
            return self.from_state(saved, drop_last)
        saved["source_state"] = planned.reweighted(saved["source_state"], weights)
        return self.from_state(saved, drop_last)

    def carried(self, state: PassState) -> Any:
        """What of a loaded state holds for the owner's later passes (a Mix's anchor)."""
        planned = self.view.planned
        return None if planned is None else planned.carried_part(state.source)

    def from_state(self, state: dict[str, Any], drop_last: bool | None = None) -> PassState:
        """Validate a checkpoint dict for this dataset (a planned source takes its part)."""
        fingerprint = self.fingerprint(drop_last)
        planned = self.view.planned
        if planned is not None:
            fingerprint["num_samples"] = self.num_samples()
            state = {**state, "num_samples": self.num_samples()}
        loaded = PassState.from_dict(state, fingerprint)
        if self.packer is not None and loaded.position > self.units(loaded.epoch):
            raise StateError(
                f"state['position']={loaded.position} is past the end of epoch "
                f"{loaded.epoch} ({self.units(loaded.epoch)} packed rows)"
            )
        if planned is None:
            return PassState(loaded.epoch, loaded.position, loaded.batches)
        part = planned.load_source_state(state.get("source_state"), loaded.epoch, loaded.position)
        return PassState(loaded.epoch, loaded.position, loaded.batches, part)

    # ---- reading -----------------------------------------------------------------
    def read(
        self,
        spec: PassSpec,
        worker_id: int,
        num_workers: int,
        *,
        skip: int = 0,
        collate: Callable[[list[Any]], Any] | None = None,
        columnar: bool = False,
        skipped: torch.Tensor | None = None,
        progress: list[int] | None = None,
        seen: list[int] | None = None,
        view: SourceView | None = None,
        clock: StageClock | None = None,
    ) -> Iterator[Any]:
        """This worker's share of the pass ``spec``: single samples, or with ``collate``
        (or ``columnar``) one collated batch per plan batch.  A generator: every check
        runs on the first ``next()``.  ``seen``: (len, fingerprint, generation) as the
        main process last saw them, for the dataset's own passes.  ``view``: the source
        to read (a reader thread's own copy; default: the dataset's).  ``clock``: times
        the stages of each batch (``loader.stats()``)."""
        check_current(spec, self.num_samples(), self.generation, seen, self.source_fingerprint)
        self.check_files()
        plan = self.stream_plan_for(spec) if spec.infinite else self.plan_for(spec)
        tap = self.tap
        ctx = ReadContext(
            self.view if view is None else view,
            plan,
            spec.rank,
            num_workers,
            worker_id,
            self.transform,
            self.on_error,
            skipped,
            [skip] if progress is None else progress,
            self.seed_generators,
            columnar and tap is None,  # the tap needs the samples themselves
            tap,
            StageClock() if clock is None else clock,
            self.rows_tap,
        )
        if progress is not None:
            progress[0] = skip
        if ctx.view.prepare_pass is not None:  # how the source fetches (remote: by range?)
            ctx.view.prepare_pass(self.shuffle_mode, num_workers)
        if self.packer is not None:
            rows_of = lambda e: self.epoch_rows(e, spec.source)  # noqa: E731
            yield from packed_items(ctx, self.packer, rows_of, skip, collate)
            return
        batches = read_batches(ctx, skip)
        if ctx.columnar:
            yield from batches
        elif collate is None:
            for batch in batches:
                yield from batch
        else:
            timed = ctx.clock
            for batch in batches:
                started = perf_counter()
                collated = collate(batch)
                timed.collate += perf_counter() - started
                yield collated

    def in_worker(self) -> bool:
        return get_worker_info() is not None
