"""What framework adapters tell the layers below them, through hooks they register.

``evenly.Dataset`` and ``evenly.DataLoader`` never import a framework adapter: an adapter
(``evenly.interop``, registered when ``evenly`` is imported) subclasses :class:`PassHooks`
and calls :func:`register`; every hook's default does nothing, so with no adapter (or no
framework in the program) a dataset's passes are its own.  Nothing here looks at a
caller: an adapter recognises a framework through the framework's objects and state.

This module imports neither torch nor any framework (``import evenly`` stays light).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from evenly.core.plan import EpochPlan
from evenly.core.topology import Topology

__all__ = [
    "PassHooks",
    "PassWatcher",
    "Wrapped",
    "before_pass",
    "check_pass",
    "driving",
    "register",
    "registered",
    "skipping",
    "under",
    "watch_pass",
]


@dataclass(frozen=True)
class Wrapped:
    """How a framework's loader drives the dataset's pass.

    ``mode``: ``"dispatch"`` (rank 0 reads for all ranks), ``"shard"`` (each rank reads its
    own share, in the wrapper's batches), or ``"hidden"`` (a wrapper is being iterated, but
    the dataset cannot be found under it; ``through`` names the type of the wrapper's
    dataset).  ``batch_size``: the wrapper's per-rank batch size (whole batches go to one
    worker)."""

    mode: str
    batch_size: int = 1
    through: str = ""


def under(wrapped: Wrapped | None, own: Topology) -> tuple[Topology, int]:
    """The (topology, plan batch size) of a pass driven by ``wrapped``; ``own``: the
    dataset's data-parallel topology."""
    if wrapped is None or wrapped.mode == "hidden":
        return own, 1
    if wrapped.mode == "dispatch":
        return Topology(0, 1), wrapped.batch_size  # rank 0 reads; the wrapper deals
    return own, wrapped.batch_size


class PassHooks:
    """One framework adapter's hooks; each default does nothing (no framework drives the
    pass).  ``dataset`` is an ``evenly.Dataset``; every hook is called in the process
    that asks (the main process or a DataLoader worker) and changes nothing of evenly's."""

    def driving(self, dataset: object) -> Wrapped | None:
        """How the framework's loader being iterated now drives ``dataset``'s own pass
        (``None``: it does not)."""
        return None

    def before_pass(self, dataset: object) -> None:
        """Called by ``Dataset.set_epoch`` in the main process (a framework's loader calls
        it before its pass starts): prepare the framework's objects for the pass, or raise
        (before the first batch) where the pass cannot be made right."""

    def check_pass(self, dataset: object, worker_dataset: object, snapshot: Wrapped | None) -> None:
        """Raise, naming the fix, if the pass about to be read would lose samples.
        ``worker_dataset``: the worker's ``get_worker_info().dataset`` (None in the main
        process); ``snapshot``: what :meth:`driving` said when the dataset was pickled
        for a spawned worker."""

    def skipping(self, dataset: object) -> int | None:
        """The batches a framework's skip-loader drops while it reads ``dataset`` in this
        process (``None``: none reads it): the dataset then serves its owning
        ``evenly.DataLoader``'s pass (see ``evenly.runtime.delegation``)."""
        return None

    @property
    def warn_padded(self) -> Callable[[EpochPlan, str], bool]:
        """A function the ``evenly.DataLoader`` calls as a pass starts with
        ``(plan, pad)`` (the pass's plan, its pad mode): it warns if the framework would
        keep the repeated samples where the user does not expect it and returns whether
        it warned (the loader asks until one did).  A property, so that the warning's
        ``stacklevel`` counts from the loader."""
        return _no_warning

    def watch_pass(self, plan: EpochPlan, pad: str, owner: object) -> PassWatcher | None:
        """Called by the ``evenly.DataLoader`` as a pass of ``plan`` starts: a watcher the
        framework follows the pass through (told of its last batch and of its end), or
        ``None``.  ``owner``: the pass's iterator (the watcher may leave when it is
        collected)."""
        return None


class PassWatcher(Protocol):
    """What a framework follows one pass of an ``evenly.DataLoader`` through."""

    remainder: int

    def last(self) -> None:
        """The batch being handed out is the pass's last."""

    def leave(self) -> None:
        """The pass ended (or was dropped)."""


def _no_warning(plan: EpochPlan, pad: str) -> bool:
    return False


_REGISTERED: list[PassHooks] = []


def register(hooks: PassHooks) -> None:
    """Add a framework adapter's hooks (once per type: registering again replaces)."""
    _REGISTERED[:] = [h for h in _REGISTERED if type(h) is not type(hooks)]
    _REGISTERED.append(hooks)


def registered() -> tuple[PassHooks, ...]:
    """The registered adapters' hooks, in registration order."""
    return tuple(_REGISTERED)


def driving(dataset: object) -> Wrapped | None:
    """The first registered adapter's answer to :meth:`PassHooks.driving`."""
    for hooks in _REGISTERED:
        wrapped = hooks.driving(dataset)
        if wrapped is not None:
            return wrapped
    return None


def before_pass(dataset: object) -> None:
    """Every registered adapter's :meth:`PassHooks.before_pass`."""
    for hooks in _REGISTERED:
        hooks.before_pass(dataset)


def check_pass(dataset: object, worker_dataset: object, snapshot: Wrapped | None) -> None:
    """Every registered adapter's :meth:`PassHooks.check_pass`."""
    for hooks in _REGISTERED:
        hooks.check_pass(dataset, worker_dataset, snapshot)


def skipping(dataset: object) -> int | None:
    """The first registered adapter's answer to :meth:`PassHooks.skipping`."""
    for hooks in _REGISTERED:
        k = hooks.skipping(dataset)
        if k is not None:
            return k
    return None


def watch_pass(plan: EpochPlan, pad: str, owner: object) -> PassWatcher | None:
    """The first registered adapter's answer to :meth:`PassHooks.watch_pass`."""
    for hooks in _REGISTERED:
        watcher = hooks.watch_pass(plan, pad, owner)
        if watcher is not None:
            return watcher
    return None
