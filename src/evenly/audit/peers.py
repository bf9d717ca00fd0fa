"""Peer data loaders audited by name: ``evenly audit --peer litdata --data DIR``.

Each factory follows the peer's documented DDP recipe and reads samples ``{"id": i}``
from ``DIR`` (``write_peer_data`` writes them in the peer's own format).  The peers are
optional (``bench/setup_peers.sh`` installs them); ``installed()`` names those that
import, with their versions.

==============  ===============================================================
name            recipe (rank and world size from torch.distributed)
==============  ===============================================================
``evenly``      ``evenly.Dataset(rows, shuffle=True, seed=0)`` in ``evenly.DataLoader``
``torch``       map-style rows + ``torch.utils.data.DistributedSampler(shuffle=True,
                seed=0)``, ``set_epoch`` every epoch
``hf``          ``datasets`` on disk -> ``to_iterable_dataset(num_shards=8)`` ->
                ``split_dataset_by_node`` -> ``shuffle(seed=0, buffer_size=64)``
``webdataset``  ``WebDataset(shards, nodesplitter=split_by_node,
                workersplitter=split_by_worker, shardshuffle=8, seed=0)``
                -> ``shuffle(64)``
``litdata``     ``StreamingDataset(dir, shuffle=True, seed=0)`` in its own
                ``StreamingDataLoader``
``mosaic``      ``streaming.StreamingDataset(local=dir, shuffle=True, shuffle_seed=0,
                batch_size=b)`` in its ``StreamingDataLoader``
``grain``       ``grain.python.DataLoader`` over an ``IndexSampler(shard_options=
                ShardOptions(rank, world_size), shuffle=True, seed=0)``
==============  ===============================================================

>>> sorted(PEERS)
['evenly', 'grain', 'hf', 'litdata', 'mosaic', 'torch', 'webdataset']
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ._types import AuditError, LoaderFactory

__all__ = ["PEERS", "installed", "peer_factory", "write_peer_data"]

#: Peer name -> the module whose version is reported.
PEERS = {
    "evenly": "evenly",
    "torch": "torch",
    "hf": "datasets",
    "webdataset": "webdataset",
    "litdata": "litdata",
    "mosaic": "streaming",
    "grain": "grain",
}

#: Shards (files) written per peer: enough for 2 ranks x 2 workers, 4 each.
SHARDS = 8


def _import(module: str) -> Any:
    if module == "streaming":
        # its streaming.vision subpackage imports torchvision, which the audit never uses
        sys.modules.setdefault("streaming.vision", types.ModuleType("streaming.vision"))
    return importlib.import_module(module)


def installed() -> dict[str, str]:
    """Peer name -> installed version, for the peers that import."""
    out = {}
    for name, module in PEERS.items():
        try:
            mod = _import(module)
        except Exception:  # not installed, or broken: not audited
            continue
        out[name] = str(getattr(mod, "__version__", "unknown"))
    return out


def _rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class _Rows:
    """Map-style rows ``{"id": i}`` of an HF dataset on disk."""

    def __init__(self, data: str) -> None:
        self.ids = np.asarray(_import("datasets").load_from_disk(data)["id"], dtype=np.int64)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, int]:
        return {"id": int(self.ids[i])}


def torch_sampler(data: str) -> tuple[Any, dict[str, Any]]:
    from torch.utils.data import DistributedSampler

    rows = _Rows(os.path.join(data, "hf"))
    return rows, {"sampler": DistributedSampler(rows, shuffle=True, seed=0)}  # type: ignore[arg-type]


def evenly_rows(data: str) -> Any:
    import evenly

    return evenly.Dataset(_Rows(os.path.join(data, "hf")), shuffle=True, seed=0)


def hf_iterable(data: str) -> Any:
    datasets = _import("datasets")
    from datasets.distributed import split_dataset_by_node

    rank, world = _rank_world()
    ds = datasets.load_from_disk(os.path.join(data, "hf")).to_iterable_dataset(num_shards=SHARDS)
    return split_dataset_by_node(ds, rank=rank, world_size=world).shuffle(seed=0, buffer_size=64)


def _key_only(sample: dict[str, Any]) -> dict[str, Any]:
    return {"id": int(sample["__key__"].rsplit("-", 1)[-1])}


def webdataset(data: str) -> Any:
    wds = _import("webdataset")
    urls = sorted(str(p) for p in Path(data, "wds").glob("*.tar"))
    ds = wds.WebDataset(
        urls,
        nodesplitter=wds.split_by_node,
        workersplitter=wds.split_by_worker,
        shardshuffle=len(urls),
        seed=0,
        empty_check=False,
    )
    return ds.shuffle(64).map(_key_only)


def _litdata_loader(data: str, **kwargs: Any) -> Any:
    litdata = _import("litdata")
    ds = litdata.StreamingDataset(os.path.join(data, "litdata"), shuffle=True, seed=0)
    return litdata.StreamingDataLoader(ds, **kwargs)


def litdata(data: str) -> LoaderFactory:
    return LoaderFactory(make=functools.partial(_litdata_loader, data))


def _mosaic_loader(data: str, **kwargs: Any) -> Any:
    streaming = _import("streaming")
    from streaming.base.util import clean_stale_shared_memory

    clean_stale_shared_memory()
    ds = streaming.StreamingDataset(
        local=os.path.join(data, "mds"),
        shuffle=True,
        shuffle_seed=0,
        batch_size=kwargs["batch_size"],
    )
    return streaming.StreamingDataLoader(ds, **kwargs)


def mosaic(data: str) -> LoaderFactory:
    return LoaderFactory(make=functools.partial(_mosaic_loader, data))


class GrainLoader:
    """Grain's ``DataLoader`` in a loop's terms: batches through ``collate_fn``, and its
    iterator's ``get_state``/``set_state`` as ``state_dict``/``load_state_dict``."""

    def __init__(self, data: str, batch_size: int, num_workers: int, collate: Any) -> None:
        _import("grain")
        gp = importlib.import_module("grain.python")
        rank, world = _rank_world()
        ids = np.load(os.path.join(data, "grain", "ids.npy"))
        self.batch_size, self.collate = batch_size, collate
        self.source = [{"id": int(i)} for i in ids]
        self.epoch = 0
        self._make: Callable[[int], Any] = lambda epoch: gp.DataLoader(
            data_source=self.source,
            sampler=gp.IndexSampler(
                num_records=len(self.source),
                shard_options=gp.ShardOptions(shard_index=rank, shard_count=world),
                shuffle=True,
                num_epochs=1,
                seed=epoch,
            ),
            worker_count=num_workers,
        )
        self._iter: Any = None
        self._pending: Any = None

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self._iter = epoch, None

    def __iter__(self) -> Iterator[Any]:
        if self._iter is None:
            self._iter = iter(self._make(self.epoch))
            if self._pending is not None:
                self._iter.set_state(self._pending)
                self._pending = None
        batch: list[Any] = []
        for record in self._iter:
            batch.append(record)
            if len(batch) == self.batch_size:
                yield self.collate(batch)
                batch = []
        if batch:
            yield self.collate(batch)
        # the pass ended: a state saved now resumes at the next epoch's start
        self._iter, self.epoch = None, self.epoch + 1

    def state_dict(self) -> dict[str, Any]:
        state = None if self._iter is None else self._iter.get_state()
        return {"epoch": self.epoch, "iterator": state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self._pending, self._iter = int(state["epoch"]), state["iterator"], None


def _grain_loader(data: str, **kwargs: Any) -> GrainLoader:
    return GrainLoader(data, kwargs["batch_size"], kwargs["num_workers"], kwargs["collate_fn"])


def grain(data: str) -> LoaderFactory:
    return LoaderFactory(make=functools.partial(_grain_loader, data))


_FACTORIES: dict[str, Callable[[str], Any]] = {
    "evenly": evenly_rows,
    "torch": torch_sampler,
    "hf": hf_iterable,
    "webdataset": webdataset,
    "litdata": litdata,
    "mosaic": mosaic,
    "grain": grain,
}


def peer_factory(name: str, data: str | Path) -> functools.partial[Any]:
    """The audit factory of peer ``name`` over ``data`` (a picklable partial)."""
    if name not in _FACTORIES:
        raise AuditError(f"unknown peer {name!r}; choose from {sorted(_FACTORIES)}")
    try:
        _import(PEERS[name])
    except Exception as exc:
        raise AuditError(
            f"peer {name!r} needs {PEERS[name]!r}, which does not import here ({exc}); "
            f"bench/setup_peers.sh installs the peers"
        ) from exc
    return functools.partial(_FACTORIES[name], str(data))


def write_peer_data(name: str, data: str | Path, n: int) -> None:
    """Write samples ``{"id": 0..n-1}`` where peer ``name`` reads them under ``data``."""
    root = Path(data)
    per = -(-n // SHARDS)
    if name in ("evenly", "torch", "hf"):
        if not (root / "hf").exists():
            _import("datasets").Dataset.from_dict({"id": list(range(n))}).save_to_disk(
                str(root / "hf"), num_shards=SHARDS
            )
    elif name == "webdataset":
        wds = _import("webdataset")
        (root / "wds").mkdir(parents=True, exist_ok=True)
        for s in range(SHARDS):
            with wds.TarWriter(str(root / "wds" / f"shard-{s:03d}.tar")) as sink:
                for i in range(s * per, min(n, (s + 1) * per)):
                    sink.write({"__key__": f"sample-{i:07d}", "txt": str(i)})
    elif name == "litdata":
        _import("litdata").optimize(
            fn=_litdata_item,
            inputs=list(range(n)),
            output_dir=str(root / "litdata"),
            chunk_size=per,
            num_workers=1,
            mode="overwrite",
        )
    elif name == "mosaic":
        _import("streaming")
        from streaming import MDSWriter

        with MDSWriter(out=str(root / "mds"), columns={"id": "int"}, size_limit=per * 64) as w:
            for i in range(n):
                w.write({"id": i})
    elif name == "grain":
        (root / "grain").mkdir(parents=True, exist_ok=True)
        np.save(root / "grain" / "ids.npy", np.arange(n, dtype=np.int64))
    else:
        raise AuditError(f"unknown peer {name!r}; choose from {sorted(_FACTORIES)}")


def _litdata_item(i: int) -> dict[str, int]:
    return {"id": i}
