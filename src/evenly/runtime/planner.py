"""The dataset as its loaders see it: one typed object that plans passes, reads them and
turns pass states into checkpoints and back.

``evenly.Dataset`` is the user's view (settings, ``set_epoch``, ``state_dict``, ``len``);
``evenly.DataLoader``, its feed, ``evenly.BatchSampler``'s shared checks and the audit
talk to a dataset only through its :class:`Planner` (``evenly.dataset.planner_of``).  What the
source offers is found once (:class:`~evenly.core.source.SourceView`), when the source is
set, not on each pass; so is the reader strategy (:func:`choose_strategy`: samples,
packed rows or a token mixture's rows), which plans, reads and checkpoints what differs
by kind; each pass takes its own from it when it starts (:meth:`Planner.pass_strategy`:
columns or samples).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import get_worker_info

from evenly.core.order import make_order
from evenly.core.packing.settings import Packing
from evenly.core.plan import PAD_MODES, EpochPlan, Order
from evenly.core.source import SourceView
from evenly.core.spec import PassSpec
from evenly.core.state import PassState
from evenly.core.stream import StreamPlan
from evenly.errors import check_int
from evenly.options import ON_ERROR, Generator, OnError, Pad, Shuffle
from evenly.runtime.checks import check_current, shuffle_mode
from evenly.runtime.clock import StageClock
from evenly.runtime.packer import PackedRows
from evenly.runtime.reader import ReadContext
from evenly.runtime.rowtap import RowsTap
from evenly.runtime.seeds import check_generators
from evenly.runtime.strategy import SAMPLES, ReadStrategy
from evenly.runtime.token_mix import TOKEN_MIX_READ, TokenMixRows, is_token_mix

__all__ = ["Planner", "ReadTap", "choose_strategy"]

logger = logging.getLogger("evenly")

#: Something that sees every sample a pass reads (the audit): called in the process that
#: reads, with the batch's source indices and samples, before they are collated.
ReadTap = Callable[[list[int], list[Any]], list[Any]]


def choose_strategy(
    pack: Packing | None, view: SourceView, on_error: str, pad: str
) -> ReadStrategy:
    """The reader strategy of a dataset's passes (the one place the kind is decided):
    samples, or with ``pack=`` packed rows (of a token mixture's pieces of documents
    where the source is an ``evenly.Mix(unit="tokens")``); what packing cannot do is
    refused here."""
    if pack is None:
        return SAMPLES  # a Mix by tokens is refused by Planner._check_transform
    token_mix = is_token_mix(view.source)
    if not isinstance(pack, Packing):
        raise TypeError(f"pack must be an evenly.Packing, got {type(pack).__name__}")
    if view.planned is not None and not token_mix:
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
    return TokenMixRows(pack) if token_mix else PackedRows(pack)


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
        #: what the passes count, plan and read (``pack=``: rows of tokens)
        self.strategy = choose_strategy(pack, self.view, on_error, pad)
        self._check_transform()
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
            self.strategy = choose_strategy(
                self.strategy.packing, self.view, self.on_error, self.pad
            )
        else:
            self.transform = transform
            self._check_transform()
        self.generation += 1

    def _check_transform(self) -> None:
        """Raise if the transform does not fit the reader strategy or the pad mode (at
        construction and when the transform is replaced)."""
        if self.strategy.packing is None and is_token_mix(self.source):
            raise ValueError(TOKEN_MIX_READ)  # its pieces of documents are packed rows
        self.strategy.check_transform(self.transform)
        if self.pad == "mask" and self.transform is None:
            raise ValueError(
                "pad='mask' needs a transform: it is where each sample learns whether it is "
                "padding (evenly.is_padding()), to mark it (a label of -100, a weight of 0); "
                "pass transform=..., or use pad='repeat' or pad='none'"
            )

    def check_files(self) -> dict[str, float]:
        """Raise if the source's files changed since it was opened (every pass start).
        Returns the requests a remote source's listing retried (``fetch_retries``, if
        any), which the pass's ``loader.stats()`` counts: they fall before any reader's
        clock starts."""
        check, io_stats = self.view.check_unchanged, self.view.io_stats
        if check is None:
            return {}
        before = 0.0 if io_stats is None else float(io_stats().get("fetch_retries", 0))
        check()
        retried = 0.0 if io_stats is None else float(io_stats().get("fetch_retries", 0)) - before
        return {"fetch_retries": retried} if retried else {}

    def num_samples(self) -> int:
        return len(self.view.source)

    # ---- units -------------------------------------------------------------------
    def units(self, epoch: int) -> int:
        """The plan's units in epoch ``epoch``: samples, or under packing that epoch's
        rows (the same every epoch under ``concat``; under ``best_fit`` it may differ)."""
        return self.strategy.units(self, epoch)

    def pass_strategy(self, columnar: bool) -> ReadStrategy:
        """The reader strategy of a pass, chosen when it starts: the dataset's, read by
        columns where the pass asks (``columnar``) and no audit tap needs the samples."""
        return self.strategy.for_pass(columnar and self.tap is None)

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
        return self.strategy.plan(self, spec)

    def stream_plan_for(self, spec: PassSpec) -> StreamPlan:
        """The endless plan over consecutive epochs of an infinite pass (under packing:
        of every epoch's rows, packed from the document order already)."""
        return self.strategy.stream_plan(self, spec)

    def check_stream(self) -> None:
        """Raise if the passes cannot be one stream of epochs (``infinite=True``)."""
        self.strategy.check_stream(self)

    def pass_start(self, epoch: int, position: int, infinite: bool) -> int:
        """A pass's ``spec.start`` from a state: the position in the epoch, or for a stream
        over epochs of one length, the stream position (else counted from ``epoch``)."""
        flat = infinite and not self.strategy.varied_epochs()
        u = self.units(0 if flat else epoch)  # rows under packing
        return (epoch * u if flat else 0) + min(position, u)

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
        fp.update(self.strategy.fingerprint())
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
        saved["source_state"] = self.strategy.reweighted(
            self, saved["source_state"], state, weights
        )
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
        self.strategy.check_state(self, loaded)
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
        checked: bool = False,
    ) -> Iterator[Any]:
        """This worker's share of the pass ``spec``: single samples, or with ``collate``
        (or ``columnar``) one collated batch per plan batch.  A generator: every check
        runs on the first ``next()``.  ``seen``: (len, fingerprint, generation) as the
        main process last saw them, for the dataset's own passes.  ``view``: the source
        to read (a reader thread's own copy; default: the dataset's).  ``clock``: times
        the stages of each batch (``loader.stats()``).  ``checked``: the owner of the pass
        checked the source's files as it started the pass (``evenly.DataLoader``'s main
        process, just before its workers read it), so not again here: a remote source's
        check is a fresh listing, and each worker's own (a client of its own, then the
        listing) was on the first batch's path.  A shard changed since is still caught: its
        download checks the version the source listed."""
        check_current(spec, self.num_samples(), self.generation, seen, self.source_fingerprint)
        if not checked:
            self.check_files()
        reads = self.pass_strategy(columnar)
        plan = reads.stream_plan(self, spec) if spec.infinite else reads.plan(self, spec)
        ctx = ReadContext(
            self.view if view is None else view,
            plan,
            spec.rank,
            num_workers,
            worker_id,
            transform=self.transform,
            on_error=self.on_error,
            skipped=skipped,
            progress=[skip] if progress is None else progress,
            generators=self.seed_generators,
            tap=self.tap,
            clock=StageClock() if clock is None else clock,
            rows_tap=self.rows_tap,
        )
        if progress is not None:
            progress[0] = skip
        if ctx.view.prepare_pass is not None:  # how the source fetches (remote: by range?)
            ctx.view.prepare_pass(self.shuffle_mode, num_workers)
        yield from reads.read(ctx, self, spec, skip, collate)

    def in_worker(self) -> bool:
        return get_worker_info() is not None
