"""Plan agreement across DDP ranks: one small exchange at the start of each epoch.

Ranks that disagree on the seed, the dataset size or the batch size do not fail: they
silently train on overlapping data, or hang when one of them has an extra batch.  So at
the start of each pass whose plan is split over the data-parallel group, every rank
posts its view of the plan to the process group's store and waits, with evenly's own
bounded timeout, for the views of the others; every rank then raises the same error
naming the fields and ranks that differ.  A rank that never posts (it built its loader
with another world size, or not at all) makes the others raise naming it, instead of
hanging until the process group's timeout.  A rank that starts a pass not split over its
group (a rank-local loader) notes it in the store (:func:`post_alone`), and the others
look at those notes while they wait: their error says that rank runs a loader of its
own, even when it hosted the store and took it with it when it exited.

Each exchange writes new keys to the store, numbered by :class:`ExchangeRounds`: a count
of the exchanges per group that this process has made, held once per process
(:data:`ROUNDS`) because the store and the groups it serves are the process's.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from collections import defaultdict
from datetime import timedelta
from typing import Any

from evenly.core.spec import PassSpec
from evenly.errors import PlanMismatchError

__all__ = [
    "DEFAULT_TIMEOUT",
    "ROUNDS",
    "ExchangeRounds",
    "check_agreement",
    "check_pass",
    "disagreements",
    "exchange",
    "group_ranks",
    "post_alone",
]

#: Seconds a rank waits for the others' views of a pass (``agreement_timeout=``).
DEFAULT_TIMEOUT = 30.0
#: Exchanges held in the store per group before old keys are deleted.
_KEEP = 2


class ExchangeRounds:
    """The number of plan exchanges this process has started, per group of ranks.

    An exchange's keys are ``evenly/agree/<group>/<round>/<rank>`` and must be new: a rank
    that found another exchange's keys would read the views left there and go on without
    waiting.  Every rank numbers a group's exchanges identically because every rank starts
    the same passes in the same order (what the agreement checks in the first place).

    Why one registry per process rather than a count per loader: the keys live in the
    default process group's store, one per process, and a group is named by its ranks
    only, so every loader over a group shares that group's keys.  A count per loader
    would start a second loader at round 0 again and read the first loader's views
    (``tests/test_agreement.py`` shows both).  The registry lives as long as the process
    (a new process group after ``destroy_process_group`` continues the count, on every
    rank alike).

    >>> rounds = ExchangeRounds()
    >>> rounds.take("a"), rounds.take("a"), rounds.take("b")
    (0, 1, 0)
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next: dict[str, int] = {}

    def take(self, group: str) -> int:
        """The round of the next exchange in ``group`` (counted from 0)."""
        with self._lock:
            round_ = self._next.get(group, 0)
            self._next[group] = round_ + 1
            return round_


#: The process's registry (see :class:`ExchangeRounds`).
ROUNDS = ExchangeRounds()


def disagreements(views: list[dict[str, Any]]) -> list[str]:
    """Describe each field on which the ranks' views differ (pure; ``views[r]`` is rank
    r's).  Also checks that the ranks claim distinct ranks of the right world size."""
    problems = []
    fields = sorted({key for view in views for key in view if key != "rank"})
    for field in fields:
        by_value: dict[str, list[int]] = defaultdict(list)
        for rank, view in enumerate(views):
            by_value[repr(view.get(field))].append(rank)
        if len(by_value) > 1:
            parts = "; ".join(
                f"{_ranks(ranks)} {value}"
                for value, ranks in sorted(by_value.items(), key=lambda kv: kv[1][0])
            )
            problems.append(f"{field}: {parts}")
    claimed = [view.get("rank") for view in views]
    if sorted(claimed, key=str) != list(range(len(views))):
        problems.append(
            f"rank: process group ranks 0..{len(views) - 1} claim data ranks {claimed} "
            f"(each must take its own rank; pass rank=None to use torch.distributed's)"
        )
    sizes = {view.get("world_size") for view in views}
    if sizes != {len(views)}:
        problems.append(
            f"world_size: the process group has {len(views)} ranks but the plan says "
            f"{sorted(sizes, key=str)}"
        )
    return problems


def _ranks(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]} has"
    return f"ranks {', '.join(map(str, ranks))} have"


def group_ranks(group: Any = None) -> list[int]:
    """Global ranks of ``group`` (the default group when None), in group-rank order."""
    import torch.distributed as dist

    if group is None:
        return list(range(dist.get_world_size()))
    return list(dist.get_process_group_ranks(group))


def check_agreement(
    view: dict[str, Any], *, group: Any = None, timeout: float = DEFAULT_TIMEOUT
) -> None:
    """Exchange every rank's view of the plan through the default store and raise
    ``PlanMismatchError`` on every rank if they differ, or if a rank of ``group`` does not
    post its view within ``timeout`` seconds."""
    import torch.distributed as dist

    from evenly.runtime.torch_compat import default_store

    ranks = group_ranks(group)
    me = dist.get_rank(group) if group is not None else dist.get_rank()
    store = default_store()
    views = exchange(store, ranks, me, view, timeout=timeout)
    problems = disagreements(views)
    if problems:
        raise PlanMismatchError(
            "evenly: the DDP ranks disagree on the plan of epoch "
            f"{view.get('epoch')}, so they would read overlapping data or hang: "
            + " | ".join(problems)
            + ". Build the dataset identically on every rank (same source, seed, "
            "shuffle, drop_last, batch_size), or switch this check off with "
            "evenly.DataLoader(..., agreement_timeout=None)."
        )


def exchange(
    store: Any,
    ranks: list[int],
    me: int,
    view: dict[str, Any],
    *,
    timeout: float,
    rounds: ExchangeRounds = ROUNDS,
) -> list[dict[str, Any]]:
    """Post ``view`` as group rank ``me`` of the group of global ``ranks`` and return
    every group rank's view (raise ``PlanMismatchError`` naming the ranks that did not
    post within ``timeout`` seconds, or that were missing when the store was lost).
    ``store`` is a torch ``Store``."""
    tag = hashlib.blake2b(repr(ranks).encode(), digest_size=6).hexdigest()
    round_ = rounds.take(tag)
    prefix = f"evenly/agree/{tag}"
    keys = [f"{prefix}/{round_}/{r}" for r in range(len(ranks))]
    from torch.distributed import DistNetworkError

    waiting = _Waiting(store, ranks, keys)
    try:
        store.set(keys[me], json.dumps(view, sort_keys=True, default=str))
        waiting.wait(timeout)
        if round_ >= _KEEP:  # every rank has read those: they all reached this round
            store.delete_key(f"{prefix}/{round_ - _KEEP}/{me}")
        return [json.loads(store.get(key)) for key in keys]
    except DistNetworkError as exc:  # the rank hosting the store is gone
        raise PlanMismatchError(waiting.lost(view.get("epoch"))) from exc
    except TimeoutError as exc:
        raise PlanMismatchError(waiting.timed_out(view.get("epoch"), timeout)) from exc


#: Seconds between looks at who has not posted yet, while waiting for the others.
_LOOK_EVERY = 1.0


class _Waiting:
    """The wait for the other ranks' views, in slices: between them it notes which
    ranks have not posted and what those said when they last ran a pass alone (see
    :func:`post_alone`), so that the error names them even after the store is lost
    (a rank that trained alone and exited takes the store with it if it hosted it)."""

    def __init__(self, store: Any, ranks: list[int], keys: list[str]) -> None:
        self.store, self.ranks, self.keys = store, ranks, keys
        self.missing: list[int] | None = None  # group ranks not posted at the last look
        self.alone: dict[int, dict[str, Any]] = {}  # group rank -> its last solo pass

    def wait(self, timeout: float) -> None:
        """Return once every rank posted; ``TimeoutError`` after ``timeout`` seconds."""
        from torch.distributed import DistNetworkError

        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                self.store.wait(self.keys, timedelta(seconds=max(min(_LOOK_EVERY, left), 0.001)))
                return
            except DistNetworkError:
                raise
            except RuntimeError:  # DistStoreError: this slice timed out
                self.look()
                if left <= _LOOK_EVERY:
                    raise TimeoutError from None

    def look(self) -> None:
        unseen = range(len(self.keys)) if self.missing is None else self.missing
        self.missing = [r for r in unseen if not self.store.check([self.keys[r]])]  # posted stays
        for r in self.missing:
            key = _alone_key(self.ranks[r])
            if self.store.check([key]):
                self.alone[r] = json.loads(self.store.get(key))

    def timed_out(self, epoch: object, timeout: float) -> str:
        missing = self.missing or []
        return (
            f"evenly: {self._named(missing)} did not start epoch {epoch} within "
            f"{timeout:g} s, so this rank would wait for data that never comes. "
            f"{self._causes(missing)}; or that rank is still busy (raise "
            f"evenly.DataLoader(..., agreement_timeout=...))"
        )

    def lost(self, epoch: object) -> str:
        host = _store_host()
        if self.missing is None:  # lost before the first look: the store's host is gone
            missing = [self.ranks.index(host)] if host in self.ranks else []
        else:
            missing = self.missing
        hosted = (
            f"global rank {host}, which hosts the process group's store, exited"
            if host is not None
            else "the process hosting the process group's store exited"
        )
        if not missing:
            return (
                f"evenly: lost the process group's store while exchanging the ranks' views "
                f"of epoch {epoch}: {hosted} or crashed, so this rank would wait for data "
                f"that never comes; see that rank's own error"
            )
        return (
            f"evenly: lost the process group's store while waiting for "
            f"{self._named(missing)}, which never joined epoch {epoch} ({hosted}: it "
            f"crashed, see its own error, or it finished a loop of its own), so this rank "
            f"would wait for data that never comes. {self._causes(missing)}"
        )

    def _named(self, missing: list[int]) -> str:
        return (
            f"rank(s) {missing} of the data-parallel group (global ranks "
            f"{[self.ranks[r] for r in missing]})"
        )

    def _causes(self, missing: list[int]) -> str:
        seen = [
            f"global rank {self.ranks[r]} last started a pass (epoch {self.alone[r]['epoch']}) "
            f"of a plan not split over this group: world_size={self.alone[r]['world_size']} "
            f"in a process group of {self.alone[r]['group_size']} rank(s)"
            for r in missing
            if r in self.alone
        ]
        return (
            (f"It is a loader built on that rank alone: {'; '.join(seen)}. " if seen else "")
            + "Likely causes: that rank built its dataset with another world_size (an "
            "explicit world_size=1) or process_group; or the loader exists on some ranks "
            "only. A rank-local loader (evaluation on one rank) needs process_group=<a "
            "group of that rank alone> (or world_size=1, which warns), and the loaders "
            "split over all ranks must be built on every rank"
        )


def _alone_key(global_rank: int) -> str:
    return f"evenly/alone/{global_rank}"


def _store_host() -> int | None:
    """The global rank whose process hosts the default store: rank 0 under
    ``init_process_group``'s env:// and tcp:// (None under torchrun's agent store)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return None
    return 0


def post_alone(store: Any, global_rank: int, view: dict[str, Any]) -> None:
    """At the start of a pass that is not split over its group (a rank-local loader),
    note it in the store: a rank that waits for this one in an agreement can then name
    it as a loader built on this rank alone.  One key per rank, overwritten."""
    store.set(_alone_key(global_rank), json.dumps(view, sort_keys=True, default=str))


def check_pass(spec: PassSpec, fingerprint: dict[str, Any], *, group: Any, timeout: float) -> None:
    """At a pass start under ``torch.distributed``: the ranks agree on the pass's plan.
    Only a plan split over the data-parallel group must agree across it (a dataset
    built with ``world_size=1`` on purpose, e.g. for evaluation, is not)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    size = len(group_ranks(group))
    if spec.world_size != size or size == 1:  # a group of one rank has no one to agree with
        if dist.get_world_size() > 1:  # others waiting for this rank can name it
            from evenly.runtime.torch_compat import default_store

            alone = {"epoch": spec.epoch, "world_size": spec.world_size, "group_size": size}
            post_alone(default_store(), dist.get_rank(), alone)
        return
    view = {
        **fingerprint,
        "batch_size": spec.batch_size,
        "epoch": spec.epoch,
        "start": spec.start,
        "infinite": spec.infinite,
        "world_size": spec.world_size,
        "rank": spec.rank,
    }
    if spec.source is not None:  # a Mix's part: its anchor and weight changes
        view["mix"] = spec.source
    check_agreement(view, group=group, timeout=timeout)
