"""``evenly.DataLoader(global_batch_size=G)``: the per-rank batch is ``G // world_size``,
so a step holds ``G`` samples whatever the world size, a world size that does not divide
``G`` is refused, and a state saved on 4 ranks resumes exactly on 2 with the same
global step (what an elastic restart does: docs/elastic.md)."""

from __future__ import annotations

from collections import Counter

import pytest

import evenly

N, G = 200, 16


def loader(rank: int, world: int, **kwargs: object) -> evenly.DataLoader:
    ds = evenly.Dataset(list(range(N)), shuffle=True, seed=5, rank=rank, world_size=world)
    kwargs.setdefault("global_batch_size", G)
    return evenly.DataLoader(ds, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(("world", "per_rank"), [(1, 16), (2, 8), (4, 4), (8, 2)])
def test_the_per_rank_batch_is_the_global_batch_over_the_world_size(
    world: int, per_rank: int
) -> None:
    ld = loader(0, world)
    assert ld.batch_size == per_rank
    assert ld.global_batch_size == G
    assert len(next(iter(ld))) == per_rank


def test_a_world_size_that_does_not_divide_it_is_refused_naming_both() -> None:
    with pytest.raises(
        ValueError,
        match=r"global_batch_size=16\) cannot be split over "
        r"world_size=3 ranks.*\[1, 2, 4, 8, 16\]",
    ):
        loader(0, 3)


def test_a_batch_size_that_disagrees_is_refused_and_one_that_agrees_is_kept() -> None:
    with pytest.raises(ValueError, match="batch_size=8 and global_batch_size=16 disagree"):
        loader(0, 4, batch_size=8)
    assert loader(0, 4, batch_size=4).batch_size == 4  # a loader rebuilt from attributes
    with pytest.raises(ValueError, match="global_batch_size"):
        loader(0, 1, global_batch_size=0)


def test_a_state_saved_on_four_ranks_resumes_on_two_with_the_same_global_step() -> None:
    before = [loader(r, 4) for r in range(4)]
    iterators = [iter(ld) for ld in before]
    seen = Counter[int]()
    for _ in range(3):  # three global steps of 16 on 4 ranks
        for it in iterators:
            seen.update(next(it).tolist())
    state = before[0].state_dict()
    assert all(ld.state_dict() == state for ld in before)

    after = [loader(r, 2) for r in range(2)]
    for ld in after:
        ld.load_state_dict(state)
    rest = [list(ld) for ld in after]
    assert len(rest[0]) == len(rest[1])  # equal batch counts on the new world
    full_steps = [step for step in zip(*rest, strict=True) if all(len(b) == 8 for b in step)]
    assert len(full_steps) == (N - 3 * G) // G
    for batches in rest:
        for batch in batches:
            seen.update(batch.tolist())
    assert seen == Counter(range(N))  # exactly once over the epoch, 4 ranks then 2
