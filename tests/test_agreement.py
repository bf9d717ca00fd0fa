"""The plan exchange's store keys: why their round count is one registry per process.

Two threads stand for two ranks (each with its own ``ExchangeRounds``, as two processes
have) over one in-memory torch store, which is what the default process group's store is
to the ranks.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
from torch.distributed import HashStore

from evenly.errors import PlanMismatchError
from evenly.runtime.agreement import ROUNDS, ExchangeRounds, exchange


def _ranks_exchange(store: Any, views: list[list[str]]) -> list[list[list[dict[str, Any]]]]:
    """Rank r posts ``{"loader": views[r][k]}`` in its k-th exchange; what each read."""
    seen: list[list[list[dict[str, Any]]]] = [[] for _ in views]

    def rank(me: int) -> None:
        rounds = ExchangeRounds()  # one registry per process
        for name in views[me]:
            got = exchange(store, [0, 1], me, {"loader": name}, timeout=10, rounds=rounds)
            seen[me].append(got)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(views))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return seen


def test_each_exchange_reads_only_its_own_round() -> None:
    """Two loaders over one group, several passes: every exchange sees the views of the
    same exchange on the other rank, never an earlier one (old rounds are deleted)."""
    order = ["train", "eval", "train", "eval", "train"]
    seen = _ranks_exchange(HashStore(), [order, order])
    for me in range(2):
        assert [[v["loader"] for v in got] for got in seen[me]] == [[n, n] for n in order]


def _both_post(store: Any, view: dict[str, Any]) -> ExchangeRounds:
    """Ranks 0 and 1 exchange ``view``; rank 0's registry afterwards."""
    rank0, rank1 = ExchangeRounds(), ExchangeRounds()
    other = threading.Thread(
        target=exchange, args=(store, [0, 1], 1, view), kwargs={"timeout": 10, "rounds": rank1}
    )
    other.start()
    exchange(store, [0, 1], 0, view, timeout=10, rounds=rank0)
    other.join(timeout=30)
    return rank0


def test_a_count_per_loader_would_read_another_loaders_views() -> None:
    """Why the count is per process, not per loader: both ranks finished the "train"
    loader's exchange; rank 0's "eval" loader with a count of its own starts at round 0
    again, finds rank 1's "train" view there and goes on without waiting.  The process's
    count gives it a new round, where it waits for rank 1 (and names it on a timeout)."""
    train, evaluation = {"loader": "train", "epoch": 0}, {"loader": "eval", "epoch": 0}
    store = HashStore()
    _both_post(store, train)
    stale = exchange(store, [0, 1], 0, evaluation, timeout=5, rounds=ExchangeRounds())
    assert stale == [evaluation, train]  # another loader's view, read as this one's

    store = HashStore()
    rank0 = _both_post(store, train)
    with pytest.raises(PlanMismatchError, match=r"rank\(s\) \[1\] .* did not start epoch 0"):
        exchange(store, [0, 1], 0, evaluation, timeout=0.3, rounds=rank0)


def test_the_process_has_one_registry() -> None:
    import evenly.runtime.agreement as agreement

    assert isinstance(ROUNDS, ExchangeRounds)
    assert agreement.exchange.__kwdefaults__["rounds"] is ROUNDS
