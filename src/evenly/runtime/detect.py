"""Where this process sits: its data-parallel rank and the number of data-parallel ranks.

Explicit arguments win; then the given ``process_group`` (the data-parallel group under
tensor/pipeline parallelism: its peers of one model replica share a group rank and so
get identical batches); then an initialised ``torch.distributed`` (the default group);
then the ``RANK`` and ``WORLD_SIZE`` variables that torchrun sets; then a single process.
``LOCAL_RANK`` is never used: it repeats on every node, so splitting data by it
duplicates samples.

Resolution happens in the main process: DataLoader workers started with ``spawn`` or
``forkserver`` have no process group, so datasets carry the resolved value to them.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

from evenly.core.topology import Topology
from evenly.errors import EvenlyWarning

__all__ = ["detect_topology", "group_of", "resolve_topology", "warn_if_rank_local"]


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


def group_of(process_group: Any) -> Any:
    """The ProcessGroup behind ``process_group``: a ProcessGroup, or a 1-D DeviceMesh (or
    one dimension of one, ``mesh["dp"]``); ``None`` stays ``None``."""
    if process_group is None:
        return None
    get_group = getattr(process_group, "get_group", None)
    if callable(get_group) and hasattr(process_group, "mesh"):  # a DeviceMesh
        if getattr(process_group, "ndim", 1) != 1:
            raise ValueError(
                "process_group: pass one dimension of the DeviceMesh, e.g. mesh['dp'], not "
                f"the whole {process_group.ndim}-D mesh"
            )
        return get_group()
    return process_group


def resolve_topology(
    rank: int | None = None, world_size: int | None = None, process_group: Any = None
) -> Topology:
    """Resolve (rank, world_size); explicit arguments override what is detected.

    With ``process_group`` (a torch ProcessGroup or a DeviceMesh dimension) the rank and
    size are this process's within that group.
    """
    group = group_of(process_group)
    if group is not None and (rank is None or world_size is None):
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "process_group= was given but torch.distributed is not initialised in this "
                "process; call torch.distributed.init_process_group() first"
            )
        group_rank = dist.get_rank(group)
        if group_rank < 0:
            raise ValueError(
                f"process_group: global rank {dist.get_rank()} is not a member of the given "
                f"group; pass the data-parallel group this rank belongs to"
            )
        return Topology(
            rank=group_rank if rank is None else rank,
            world_size=dist.get_world_size(group) if world_size is None else world_size,
        )
    return detect_topology(rank, world_size)


def detect_topology(rank: int | None = None, world_size: int | None = None) -> Topology:
    """Resolve (rank, world_size) from the default group or torchrun's variables;
    explicit arguments override what is detected."""
    detected_rank, detected_world = 0, 1
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        detected_rank, detected_world = dist.get_rank(), dist.get_world_size()
    else:
        env_rank, env_world = _env_int("RANK"), _env_int("WORLD_SIZE")
        if env_world is not None:
            detected_world = env_world
            detected_rank = env_rank if env_rank is not None else 0
    return Topology(
        rank=detected_rank if rank is None else rank,
        world_size=detected_world if world_size is None else world_size,
    )


def is_detected_from_environment(process_group: Any = None) -> bool:
    """Whether a topology can be detected now (a process group or torchrun's variables):
    only then may a dataset fix it for its workers."""
    import torch.distributed as dist

    if process_group is not None or (dist.is_available() and dist.is_initialized()):
        return True
    return os.environ.get("WORLD_SIZE") not in (None, "")


def warn_if_rank_local(world_size: int | None, process_group: Any, what: str) -> bool:
    """Warn (once: the caller keeps the flag) when ``world_size=1`` was given explicitly
    while this process is one of several ranks of torch.distributed's default group:
    every rank then reads every sample.  A ``process_group`` (the user's own group) says
    it is meant; returns whether it warned."""
    import torch.distributed as dist

    if world_size != 1 or process_group is not None:
        return False
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return False
    warnings.warn(
        f"evenly: {what} was built with world_size=1, but this process is rank "
        f"{dist.get_rank()} of {dist.get_world_size()} in torch.distributed's default group: "
        f"every rank reads every sample. For a rank-local loader (evaluation on one rank) "
        f"pass process_group=<a group of this rank alone> (that silences this warning); "
        f"to split the data over the ranks, leave world_size unset",
        EvenlyWarning,
        stacklevel=4,
    )
    return True
