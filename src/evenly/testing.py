"""``evenly.testing``: the audit in your own test suite (``pip install 'evenly[testing]'``).

``assert_loader_correct`` runs ``evenly audit`` on a factory under real DDP ranks and
DataLoader workers, resume included, and raises ``AssertionError`` with the findings
when one fails.  The factory is named ``"module.path:attribute"`` (the spawned rank
processes import it; a module-level function or a ``functools.partial`` of one works
too), and returns the rank's dataset, ``(dataset, dataloader_kwargs)`` or an
``evenly.audit.LoaderFactory``::

    # tests/test_pipeline.py
    from evenly.testing import assert_loader_correct

    def make_dataset():
        return evenly.Dataset(my_rows(), shuffle=True)

    def test_pipeline_is_exact():
        assert_loader_correct("tests.test_pipeline:make_dataset", world_size=2,
                              num_workers=2, epochs=2, resume=True)

Across topologies, with hypothesis (keep examples few: each is a real audit)::

    from hypothesis import given, settings
    from evenly.testing import topologies

    @settings(max_examples=10, deadline=None)
    @given(topologies())
    def test_any_topology(topology):
        assert_loader_correct("tests.test_pipeline:make_dataset", **topology.kwargs())

With ``pytest_plugins = ["evenly.testing"]`` in a ``conftest.py``, the
``assert_loader`` fixture is ``assert_loader_correct``.

``check_resume`` is the checkpoint harness, in one process (ranks simulated with
explicit ``rank=``/``world_size=``, DataLoader workers real): it saves the state after
every batch of an evenly loader (``evenly_loader``, ``torch_loader``, ``sampler_loader``,
``stateful_loader``, or your own ``Rig``), loads it into fresh loaders under another
``Layout`` and asserts, with the rules ``evenly audit --resume`` applies, that the rest
of the epoch and the next one are exactly what evenly's plan deals::

    from evenly.testing import Layout, check_resume, evenly_loader

    def test_resumes_onto_one_rank():
        make = evenly_loader(lambda: list(range(36)), shuffle=True, seed=4)
        check_resume(make, Layout(2, 0, 4), Layout(1, 0, 6), num_samples=36)

>>> Topology(world_size=2, num_workers=1, batch_size=4).kwargs()["resume_world_size"]
2
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hypothesis.strategies import SearchStrategy

    from evenly.audit import AuditResult
    from evenly.audit._harness import (
        Layout,
        LengthMismatch,
        Make,
        Report,
        Rig,
        StateShapeChanged,
        check_resume,
        evenly_loader,
        sampler_loader,
        stateful_loader,
        torch_loader,
    )

__all__ = [
    "Layout",
    "LengthMismatch",
    "Make",
    "Report",
    "Rig",
    "StateShapeChanged",
    "Topology",
    "assert_loader",
    "assert_loader_correct",
    "check_resume",
    "evenly_loader",
    "sampler_loader",
    "stateful_loader",
    "topologies",
    "torch_loader",
]

#: The checkpoint harness's names, loaded on first use (it imports torch).
_HARNESS = frozenset(
    {
        "Layout",
        "LengthMismatch",
        "Make",
        "Report",
        "Rig",
        "StateShapeChanged",
        "check_resume",
        "evenly_loader",
        "sampler_loader",
        "stateful_loader",
        "torch_loader",
    }
)


def __getattr__(name: str) -> Any:
    if name in _HARNESS:
        from evenly.audit import _harness

        return getattr(_harness, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def assert_loader_correct(
    factory: str | Callable[[], Any],
    *,
    world_size: int = 2,
    num_workers: int = 2,
    epochs: int = 2,
    batch_size: int = 10,
    resume: bool = True,
    resume_world_size: int | None = None,
    resume_workers: int | None = None,
    resume_at: Sequence[float] = (),
    set_weights: Sequence[tuple[int, int, Mapping[str, float]]] = (),
    strict: bool = False,
    id_fn: Callable[[Any], Any] | None = None,
    expected: int | None = None,
    timeout: float = 300.0,
    nodes: int = 1,
    resume_nodes: int | None = None,
) -> AuditResult:
    """Audit ``factory`` (see ``evenly.audit.run`` for the arguments) and raise
    ``AssertionError`` naming every FAIL finding (every WARN too with ``strict=True``:
    a loader that cannot resume, an unknown length...).  Returns the result otherwise.

    ``nodes`` splits the ranks over simulated nodes (``world_size / nodes`` each, with
    torchrun's multi-node variables): a dataset that splits by ``LOCAL_RANK`` fails.

    ``evenly.audit.AuditError`` (the audit could not run: a factory that does not
    import, a rank that failed, a timeout) propagates as it is.
    """
    from evenly.audit import run

    result = run(
        factory,
        num_workers=num_workers,
        world_size=world_size,
        epochs=epochs,
        batch_size=batch_size,
        id_fn=id_fn,
        expected=expected,
        timeout=timeout,
        resume=resume,
        resume_world_size=resume_world_size,
        resume_workers=resume_workers,
        resume_at=resume_at,
        set_weights=set_weights,
        nodes=nodes,
        resume_nodes=resume_nodes,
    )
    bad = {"FAIL", "WARN"} if strict else {"FAIL"}
    failed = [f for f in result.findings if f.status in bad]
    if failed:
        lines = "\n".join(f"  {f.status} {f.title}: {f.detail}" for f in failed)
        ranks = f"{world_size} rank(s)"
        if nodes > 1:
            ranks = f"{nodes} nodes x {world_size // nodes} ranks"
        where = f"{ranks} x {num_workers} worker(s), batch {batch_size}, {epochs} epoch(s)"
        if resume:
            where += (
                f", resumed onto {resume_world_size or world_size} x "
                f"{num_workers if resume_workers is None else resume_workers}"
            )
            if (resume_nodes or nodes) > 1:
                where += f" on {resume_nodes or nodes} nodes"
        raise AssertionError(f"evenly audit of {result.factory} ({where}):\n{lines}")
    return result


@dataclass(frozen=True)
class Topology:
    """One audit topology: ranks and workers, batch size, and where and onto what it
    resumes (``resume_at``: a fraction of the first epoch)."""

    world_size: int
    num_workers: int
    batch_size: int
    resume_world_size: int | None = None
    resume_workers: int | None = None
    resume_at: float | None = None

    def kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``assert_loader_correct`` (or ``evenly.audit.run``)."""
        return {
            "world_size": self.world_size,
            "num_workers": self.num_workers,
            "batch_size": self.batch_size,
            "resume_world_size": self.resume_world_size or self.world_size,
            "resume_workers": (
                self.num_workers if self.resume_workers is None else self.resume_workers
            ),
            "resume_at": () if self.resume_at is None else (self.resume_at,),
        }


def topologies(
    *,
    max_world_size: int = 3,
    max_workers: int = 2,
    batch_sizes: Sequence[int] = (1, 2, 4, 8),
) -> SearchStrategy[Topology]:
    """A hypothesis strategy over ``Topology``: world size and workers before and after
    the resume, batch size, and the resume point (needs ``hypothesis``)."""
    from hypothesis import strategies as st

    return st.builds(
        Topology,
        world_size=st.integers(1, max_world_size),
        num_workers=st.integers(0, max_workers),
        batch_size=st.sampled_from(list(batch_sizes)),
        resume_world_size=st.integers(1, max_world_size),
        resume_workers=st.integers(0, max_workers),
        resume_at=st.floats(0.05, 1.0, allow_nan=False),
    )


def _fixture() -> Any:
    """The pytest fixture ``assert_loader``: ``assert_loader_correct`` itself."""
    try:
        import pytest
    except ImportError:  # pragma: no cover - pytest is part of evenly[testing]
        return None

    @pytest.fixture(name="assert_loader")
    def assert_loader() -> Callable[..., AuditResult]:
        return assert_loader_correct

    return assert_loader


#: ``pytest_plugins = ["evenly.testing"]`` makes it available to a test suite.
assert_loader = _fixture()
