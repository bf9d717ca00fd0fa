"""The reader strategy of a dataset's passes: what a pass's positions count, how its plan
is built, how a batch of positions is read, and what it adds to a checkpoint.

One implementation per kind: :class:`Samples` and :class:`Columns` here,
:class:`~evenly.runtime.packer.PackedRows` (``pack=``) and
:class:`~evenly.runtime.token_mix.TokenMixRows` (a packed ``evenly.Mix(unit="tokens")``).
The planner chooses the dataset's when its source or packing is set
(:func:`evenly.runtime.planner.choose_strategy`), and each pass's when the pass starts
(:meth:`ReadStrategy.for_pass`: columns or samples); the planner and the loader call the
strategy, never branch on the kind (the audit, which records what it checks per kind,
looks at which one a dataset has).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

from evenly.core.packing.settings import Packing
from evenly.core.plan import EpochPlan, Order
from evenly.core.source import SourceView
from evenly.core.spec import PassSpec
from evenly.core.state import PassState
from evenly.core.stream import StreamPlan
from evenly.runtime.clock import perf_counter
from evenly.runtime.reader import MAX_GROUP, ReadContext, read_columnar, read_samples

__all__ = [
    "COLUMNS",
    "SAMPLES",
    "Columns",
    "Plans",
    "ReadStrategy",
    "Samples",
    "planned_reweighted",
]


class Plans(Protocol):
    """What a strategy asks of the dataset's planner: its settings and its orders."""

    @property
    def view(self) -> SourceView: ...

    @property
    def seed(self) -> int: ...

    @property
    def shuffle_mode(self) -> str: ...

    @property
    def block_shards(self) -> int: ...

    @property
    def pad(self) -> str: ...

    @property
    def transform(self) -> Callable[[Any], Any] | None: ...

    def num_samples(self) -> int: ...

    def order_for(
        self, epoch: int, num_samples: int, step: int, start: int, part: Any = None
    ) -> Order | None: ...


class ReadStrategy(Protocol):
    """How the passes of one dataset count, plan and read their units."""

    @property
    def packing(self) -> Packing | None:
        """The packing (``pack=``); ``None`` when the units are samples."""
        ...

    @property
    def columnar(self) -> bool:
        """Whether batches are read as columns (``source.read_columns``)."""
        ...

    def for_pass(self, columnar: bool) -> ReadStrategy:
        """This pass's strategy: read by columns where ``columnar`` and the kind allows."""
        ...

    def units(self, plans: Plans, epoch: int) -> int:
        """The plan's units in epoch ``epoch`` (samples, or packed rows)."""
        ...

    def varied_epochs(self) -> bool:
        """Whether epochs differ in units."""
        ...

    def plan(self, plans: Plans, spec: PassSpec) -> EpochPlan:
        """The epoch plan of the pass ``spec`` (not an infinite one)."""
        ...

    def stream_plan(self, plans: Plans, spec: PassSpec) -> StreamPlan:
        """The endless plan over consecutive epochs of the infinite pass ``spec``."""
        ...

    def fingerprint(self) -> dict[str, Any]:
        """What a checkpoint state must agree on besides the dataset's settings."""
        ...

    def check_state(self, plans: Plans, state: PassState) -> None:
        """Raise ``StateError`` if a loaded state's position is not in its epoch."""
        ...

    def check_transform(self, transform: Callable[[Any], Any] | None) -> None:
        """Raise if ``transform`` cannot be used with this kind."""
        ...

    def check_stream(self, plans: Plans) -> None:
        """Raise if the passes cannot be one stream of epochs (``infinite=True``)."""
        ...

    def reweighted(
        self,
        plans: Plans,
        source_state: dict[str, Any],
        state: PassState,
        weights: Mapping[str, float],
    ) -> dict[str, Any]:
        """A planned source's checkpointed ``source_state`` after ``set_weights`` at
        ``state``'s position."""
        ...

    def read(
        self,
        ctx: ReadContext,
        plans: Plans,
        spec: PassSpec,
        skip: int,
        collate: Callable[[list[Any]], Any] | None,
    ) -> Iterator[Any]:
        """This worker's share of the pass, from its unit ``skip`` on: single units, or
        with ``collate`` one collated batch per plan batch."""
        ...

    def readers(self, num_workers: int) -> int:
        """Reader threads for a thread pass of ``num_workers`` shares."""
        ...

    def ahead(self, batch_size: int) -> int:
        """Batches a reader thread may hold beyond its queue (those of one read)."""
        ...

    def releases_gil(self, plans: Plans) -> bool:
        """Whether the reads are mostly copies that release the GIL (threads then help)."""
        ...


def planned_reweighted(
    plans: Plans, source_state: dict[str, Any], weights: Mapping[str, float]
) -> dict[str, Any]:
    """A planned source's own reweighting of its checkpointed state (an ``evenly.Mix``)."""
    planned = plans.view.planned
    if planned is None:  # the planner refuses set_weights on any other source first
        raise TypeError(
            f"set_weights needs an evenly.Mix source, not {type(plans.view.source).__name__}"
        )
    out: dict[str, Any] = planned.reweighted(source_state, weights)
    return out


class Samples:
    """The units are the source's samples, read one by one (or in one ``__getitems__``
    call per batch), each transformed under its own seeds."""

    packing: Packing | None = None
    columnar = False

    def for_pass(self, columnar: bool) -> ReadStrategy:
        return COLUMNS if columnar else self

    def units(self, plans: Plans, epoch: int) -> int:
        return plans.num_samples()

    def varied_epochs(self) -> bool:
        return False

    def plan(self, plans: Plans, spec: PassSpec) -> EpochPlan:
        return EpochPlan(
            num_samples=spec.num_samples,
            world_size=spec.world_size,
            batch_size=spec.batch_size,
            drop_last=spec.drop_last,
            seed=plans.seed,
            epoch=spec.epoch,
            start=spec.start,
            pad=plans.pad,
            order=plans.order_for(
                spec.epoch,
                spec.num_samples,
                spec.world_size * spec.batch_size,
                spec.start,
                spec.source,
            ),
        )

    def stream_plan(self, plans: Plans, spec: PassSpec) -> StreamPlan:
        step = spec.world_size * spec.batch_size
        return StreamPlan(
            num_samples=spec.num_samples,
            world_size=spec.world_size,
            batch_size=spec.batch_size,
            seed=plans.seed,
            start=spec.start,
            orders=lambda epoch: plans.order_for(epoch, spec.num_samples, step, 0),
            lengths=None,
            first_epoch=0,
        )

    def fingerprint(self) -> dict[str, Any]:
        return {}

    def check_state(self, plans: Plans, state: PassState) -> None:
        return None

    def check_transform(self, transform: Callable[[Any], Any] | None) -> None:
        return None

    def check_stream(self, plans: Plans) -> None:
        """A source that plans its own epochs (an ``evenly.Mix``) lays its steps out from
        each epoch's start, which a stream of epochs does not keep: refused until it can."""
        if plans.view.planned is not None:
            raise ValueError(
                f"evenly.DataLoader(infinite=True) does not support a "
                f"{type(plans.view.source).__name__} source yet: its per-step proportions "
                f"and its resume are defined per epoch, and a stream of epochs would "
                f"silently repeat or skip samples; train a Mix epoch by epoch (infinite=False)"
            )

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
        batches = read_samples(ctx, skip)
        if collate is None:
            for batch in batches:
                yield from batch
            return
        timed = ctx.clock
        for batch in batches:
            started = perf_counter()
            collated = collate(batch)
            timed.collate += perf_counter() - started
            yield collated

    def readers(self, num_workers: int) -> int:
        return num_workers

    def ahead(self, batch_size: int) -> int:
        return 1

    def releases_gil(self, plans: Plans) -> bool:
        return False


class Columns(Samples):
    """Samples read a batch at a time as columns (``source.read_columns``): one dict of
    columns per batch, no per-sample objects, no transform."""

    columnar = True

    def for_pass(self, columnar: bool) -> ReadStrategy:
        return self if columnar else SAMPLES

    def read(
        self,
        ctx: ReadContext,
        plans: Plans,
        spec: PassSpec,
        skip: int,
        collate: Callable[[list[Any]], Any] | None,
    ) -> Iterator[Any]:
        return read_columnar(ctx, skip)

    def ahead(self, batch_size: int) -> int:
        return MAX_GROUP

    def releases_gil(self, plans: Plans) -> bool:
        return True


SAMPLES = Samples()
COLUMNS = Columns()
