"""``evenly.audit``: run a dataset factory under real ranks and workers, and judge it.

>>> import functools, evenly
>>> import examples.talk_attempts as talk                       # doctest: +SKIP
>>> result = evenly.audit.run(functools.partial(talk.naive, size=40),  # doctest: +SKIP
...                           num_workers=2, world_size=2, epochs=2, batch_size=10)
>>> result.ok, result.finding("duplicates").detail              # doctest: +SKIP
(False, 'epoch 0: 120 extra deliveries, every sample delivered 4x; ...')
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ._coverage import merged_pieces
from ._factory import Factory, describe, resolve
from ._findings import all_findings
from ._result import AuditResult
from ._types import (
    I64,
    AuditError,
    IdFn,
    Records,
    Settings,
    ranks_per_node,
    row_label,
    stacked,
)

I64_EMPTY = np.zeros(0, dtype=np.int64)

if TYPE_CHECKING:
    from ._collect import RankResult

__all__ = ["AuditResult", "audit_many", "build_records", "run"]


def _encode(ids: I64 | list[Any]) -> tuple[I64, list[str] | None, list[Any]]:
    """Integer codes for the ids, their labels (None if the ids are ints) and the
    distinct id values indexed by code (for shard_fn)."""
    if isinstance(ids, np.ndarray):
        return ids.astype(np.int64, copy=False), None, []
    if all(isinstance(i, int | np.integer) and not isinstance(i, bool) for i in ids):
        codes = np.asarray(ids, dtype=np.int64)
        return codes, None, []
    distinct = sorted(set(ids), key=lambda v: (type(v).__name__, str(v)))
    index = {v: k for k, v in enumerate(distinct)}
    codes = np.fromiter((index[v] for v in ids), dtype=np.int64, count=len(ids))
    return codes, [str(v) for v in distinct], distinct


def _joined_ids(results: list[RankResult]) -> I64 | list[Any]:
    """The ids of several results one after the other (an array where all are ints)."""
    if all(isinstance(r.ids, np.ndarray) for r in results):
        return np.concatenate([np.asarray(r.ids, dtype=np.int64) for r in results] or [I64_EMPTY])
    return [i for r in results for i in list(r.ids)]


def _shards(codes: I64, distinct: list[Any], shard_fn: Callable[[Any], Any]) -> I64:
    """The shard of each row, as small integer codes, calling ``shard_fn`` once per id."""
    if distinct:
        values, inverse = distinct, codes
    else:
        uniq, inv = np.unique(codes, return_inverse=True)
        values, inverse = [int(v) for v in uniq], inv.reshape(-1)
    groups = [shard_fn(v) for v in values]
    table = {g: k for k, g in enumerate(dict.fromkeys(groups))}
    lookup = np.asarray([table[g] for g in groups], dtype=np.int64)
    out: I64 = lookup[inverse]
    return out


def build_records(
    ranks: list[RankResult],
    settings: Settings,
    *,
    expected: int | None = None,
    shard_fn: Callable[[Any], Any] | None = None,
) -> Records:
    """Merge the ranks' results into one ``Records``."""
    cols = stacked(ranks)
    reads: list[I64] = []
    for result in ranks:
        read = np.asarray(result.reads, dtype=np.int64).reshape(-1)
        reads.append(read if len(read) == len(result.ids) else np.full(len(result.ids), -1))
    codes, labels, distinct = _encode(_joined_ids(ranks))
    rank0 = ranks[0]
    mix = rank0.mix
    pack, pieces = rank0.pack, None
    if pack is not None:
        pieces = merged_pieces(ranks)
    reference, source = rank0.expected, rank0.expected_source
    if expected is not None:
        reference, source = expected, "given count"
    elif source.endswith("on rank 0") and reference is not None:
        # An iterable's len() may be global or per rank: take whichever is larger, it or
        # the distinct ids seen over all epochs (pass expected= to be exact).
        seen = len(np.unique(codes))
        if seen > reference:
            reference, source = seen, "distinct ids seen"
    return Records(
        ids=codes,
        rank=cols["rank"],
        worker=cols["worker"],
        epoch=cols["epoch"],
        batch=cols["batch"],
        pos=cols["pos"],
        draws=cols["draws"],
        per_rank=[r for result in ranks for r in result.per_rank],
        world_size=settings.world_size,
        num_workers=settings.num_workers,
        epochs=settings.epochs,
        batch_size=settings.batch_size,
        expected=reference,
        expected_source=source,
        labels=labels,
        shards=None if shard_fn is None else _shards(codes, distinct, shard_fn),
        warnings=sorted({w for result in ranks for w in result.warnings}),
        mix=mix,
        # the index each row was read from (-1 where a rank recorded none)
        reads=None if mix is None else np.concatenate(reads).astype(np.int64),
        pack=pack,
        pieces=pieces,
        dropped=_dropped(ranks),
        nodes=settings.nodes,
        seen=[result.seen for result in ranks],
    )


def _dropped(ranks: list[RankResult]) -> dict[int, list[str]]:
    """Per epoch, the samples read but left out of the collated batches, once each."""
    out: dict[int, list[str]] = {}
    for result in ranks:
        for epoch, i in result.dropped:
            out.setdefault(epoch, []).append(str(i))
    return {e: list(dict.fromkeys(names)) for e, names in sorted(out.items())}


def _check(name: str, value: int, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def _changes(
    changes: Sequence[tuple[int, int, Mapping[str, float]]],
) -> tuple[tuple[int, int, tuple[tuple[str, float], ...]], ...]:
    """``set_weights=`` checked: ``(epoch, batch, {name: weight})``, one change a batch."""
    out = []
    for item in changes:
        if not (isinstance(item, tuple | list) and len(item) == 3):
            raise ValueError(f"set_weights items must be (epoch, batch, weights), got {item!r}")
        epoch, batch, weights = item
        _check("set_weights epoch", epoch, 0)
        _check("set_weights batch", batch, 1)
        if not isinstance(weights, Mapping) or not weights:
            raise ValueError(
                f"set_weights weights must be a {{name: weight}} dict, got {weights!r}"
            )
        out.append((epoch, batch, tuple((str(k), float(v)) for k, v in weights.items())))
    where = [(e, b) for e, b, _ in out]
    if len(set(where)) != len(where):
        raise ValueError(f"set_weights names a batch twice: {sorted(where)}")
    return tuple(sorted(out))


def _codes(results: list[RankResult]) -> tuple[list[I64], Callable[[int], str]]:
    """Integer codes for the ids of several runs, in one code space, and their labels."""
    codes, labels, _ = _encode(_joined_ids(results))
    bounds = np.cumsum([0] + [len(r.ids) for r in results])
    split = [codes[a:b] for a, b in itertools.pairwise(bounds)]
    return split, (str if labels is None else labels.__getitem__)


def audit_many(
    factories: Sequence[Factory],
    *,
    num_workers: int = 2,
    world_size: int = 2,
    epochs: int = 2,
    batch_size: int = 10,
    id_fn: IdFn | None = None,
    shard_fn: Callable[[Any], Any] | None = None,
    expected: int | None = None,
    timeout: float = 300.0,
    resume: bool = False,
    resume_world_size: int | None = None,
    resume_workers: int | None = None,
    resume_at: Sequence[float] = (),
    set_weights: Sequence[tuple[int, int, Mapping[str, float]]] = (),
    progress: Callable[[str], None] | None = None,
    nodes: int = 1,
    resume_nodes: int | None = None,
) -> list[AuditResult]:
    """Audit several factories in one group of rank processes (cheaper than one
    ``run`` each); arguments as for ``run``."""
    settings = Settings(
        num_workers=_check("num_workers", num_workers, 0),
        world_size=_check("world_size", world_size, 1),
        epochs=_check("epochs", epochs, 1),
        batch_size=_check("batch_size", batch_size, 1),
        timeout=float(timeout),
        resume_at=tuple(float(f) for f in resume_at),
        set_weights=_changes(set_weights),
        nodes=nodes,
    )
    ranks_per_node(settings.world_size, nodes)
    if any(not 0.0 < f <= 1.0 for f in settings.resume_at):
        raise ValueError(f"resume_at must be fractions in (0, 1], got {list(resume_at)}")
    if expected is not None:
        _check("expected", expected, 0)
    if resume_world_size is not None:
        _check("resume_world_size", resume_world_size, 1)
    if resume_nodes is not None or resume_world_size is not None:
        # the default: the audit's nodes, which must then divide the resumed world size
        ranks_per_node(
            world_size if resume_world_size is None else resume_world_size,
            nodes if resume_nodes is None else resume_nodes,
            ("resume_world_size", "resume_nodes"),
        )
    if resume_workers is not None:
        _check("resume_workers", resume_workers, 0)
    for factory in factories:
        if isinstance(factory, str):
            resolve(factory)  # fail fast, in this process, with a clear message
        elif not callable(factory):
            raise AuditError(f"a factory must be callable or 'module:attr', got {factory!r}")
    from ._launch import start_fork_server

    start_fork_server()  # it imports torch while this process imports the rest
    # Deferred: running ranks needs torch.distributed and the tracing wrappers, which
    # ``import evenly`` (that imports this module for ``evenly.audit``) does not.
    from ._collect import Job
    from ._resume import collect

    if not resume:
        if progress is not None:
            on = f" on {nodes} nodes" if nodes > 1 else ""
            progress(f"running {len(factories)} factory(ies) on {world_size} ranks{on}")
        per_job = collect([Job(f, id_fn) for f in factories], settings, progress)
        results = []
        for factory, ranks in zip(factories, per_job, strict=True):
            records = build_records(ranks, settings, expected=expected, shard_fn=shard_fn)
            found = all_findings(records)
            results.append(AuditResult(describe(factory), settings, records, found))
        return results
    from ._resume import resume_findings, run_resume

    outcome = run_resume(
        [Job(f, id_fn, stateful=True) for f in factories],
        settings,
        world_size=resume_world_size,
        num_workers=resume_workers,
        nodes=resume_nodes,
        progress=progress,
    )
    results = []
    for factory, (refs, report) in zip(factories, outcome, strict=True):
        records = build_records(refs, settings, expected=expected, shard_fn=shard_fn)
        everything = refs + [r for s in report.stops for seg in s.segments for r in seg]
        split, label = _codes(everything)
        if refs and refs[0].pack is not None:
            label = row_label  # a packed row's id: its first token
        code_of = {id(r): c for r, c in zip(everything, split, strict=True)}
        report.findings = resume_findings(report, refs, code_of, settings, label)
        found = all_findings(records) + report.findings
        results.append(AuditResult(describe(factory), settings, records, found, report))
    return results


def run(
    factory: Factory,
    *,
    num_workers: int = 2,
    world_size: int = 2,
    epochs: int = 2,
    batch_size: int = 10,
    id_fn: IdFn | None = None,
    shard_fn: Callable[[Any], Any] | None = None,
    expected: int | None = None,
    timeout: float = 300.0,
    resume: bool = False,
    resume_world_size: int | None = None,
    resume_workers: int | None = None,
    resume_at: Sequence[float] = (),
    set_weights: Sequence[tuple[int, int, Mapping[str, float]]] = (),
    nodes: int = 1,
    resume_nodes: int | None = None,
) -> AuditResult:
    """Run ``factory`` in ``world_size`` real rank processes, each through a DataLoader
    with ``num_workers`` workers for ``epochs`` epochs, and judge what was delivered.

    ``evenly.audit.run``: the Python entry of ``evenly audit`` (it replaces calling
    ``evenly.audit(...)``, which still works until evenly 0.3 with a
    ``DeprecationWarning``).

    Args:
        factory: a picklable callable (module-level function, ``functools.partial``) or
            ``"module.path:attribute"``, called once in each rank process.  It returns
            the rank's dataset, or ``(dataset, dataloader_kwargs)`` for a sampler,
            ``worker_init_fn``, ``collate_fn``, ``persistent_workers``...
        id_fn: names a sample (default: ``evenly.audit.default_id``); must be picklable.
        shard_fn: maps an id to its shard/group (file, class folder) to measure how often
            neighbours in a batch share a group; runs in this process.
        expected: distinct samples per epoch across all ranks, when ``len()`` does not
            say (by default: ``len(source)`` of an evenly.Dataset, else ``len(dataset)``).
        timeout: seconds before a stuck audit is stopped.
        resume: also stop every rank at a few batches (early, middle, the last batch,
            the epoch boundary, a second resume), save the loader's state, load it in
            fresh processes and compare the rest with the uninterrupted run (one
            ``resume_*`` finding per stop; ``resume`` says onto what it resumed).
            ``evenly.Dataset`` runs under ``evenly.DataLoader``, a dataset with
            ``state_dict``/``load_state_dict`` under torchdata's ``StatefulDataLoader``,
            a ``LoaderFactory`` under its own loader; anything else "cannot resume"
            (a WARN).
        resume_world_size: the ranks to resume onto (default: the audit's), where the
            state allows it (else a WARN says so).
        resume_workers: the workers per rank to resume onto (default: the audit's).
        resume_at: more stops, as fractions of the first epoch (0.5: its middle batch).
        set_weights: ``(epoch, batch, {name: weight})``: every rank calls
            ``loader.set_weights(weights)`` after batch ``batch`` (counted from 1) of
            epoch ``epoch`` (an ``evenly.DataLoader`` over an ``evenly.Mix``, or a
            ``LoaderFactory``'s loader with ``set_weights``), resumed runs too; the
            mixture findings judge each source's share against the weights in force.
        nodes: simulated nodes the ranks are split over, ``world_size / nodes`` ranks each
            (a multiple: else ``ValueError``), each rank with the variables torchrun gives
            a multi-node job (``GROUP_RANK``, ``LOCAL_RANK`` within the node...) and, on
            Linux as root, its node's own host name (``evenly-node-<n>``).
        resume_nodes: the nodes to resume onto (default: ``nodes``).
    """
    return audit_many(
        [factory],
        num_workers=num_workers,
        world_size=world_size,
        epochs=epochs,
        batch_size=batch_size,
        id_fn=id_fn,
        shard_fn=shard_fn,
        expected=expected,
        timeout=timeout,
        resume=resume,
        resume_world_size=resume_world_size,
        resume_workers=resume_workers,
        resume_at=resume_at,
        set_weights=set_weights,
        nodes=nodes,
        resume_nodes=resume_nodes,
    )[0]
