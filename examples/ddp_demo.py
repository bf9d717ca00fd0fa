"""The main job: real DDP training on generated data, checking evenly's guarantees.

Run it with ``scripts/demo`` (which installs everything), or by hand::

    torchrun --nproc-per-node 2 examples/ddp_demo.py

Each rank trains a tiny model with DistributedDataParallel (gloo, CPU) over an
``evenly.Dataset`` read by 2 DataLoader workers.  Every figure printed is computed from
the sample ids the training loop actually received, gathered from all ranks; next to it,
the same run over the naive ``IterableDataset`` of the talk shows what evenly prevents.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.utils.data as tud
from torch import nn

import evenly

FEATURES = 16


def make_sample(i: int) -> dict[str, Any]:
    """Generated data: sample ``i`` has a fixed feature vector and a linear target."""
    g = torch.Generator().manual_seed(i)
    x = torch.randn(FEATURES, generator=g)
    return {"id": i, "x": x, "y": x.sum(dim=0, keepdim=True)}


class Generated:
    """A map-style source of ``n`` generated samples (no I/O)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        return make_sample(i)


def augment(sample: dict[str, Any]) -> dict[str, Any]:
    """A random augmentation: evenly seeds torch per sample, so each draw is its own."""
    noise = torch.randn(FEATURES) * 0.01
    return {**sample, "x": sample["x"] + noise, "draw": float(noise[0])}


class Naive(tud.IterableDataset[dict[str, Any]]):
    """The talk's first attempt: every worker of every rank yields everything."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for i in range(self.n):
            yield augment(make_sample(i))


def gather(obj: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def epoch_report(
    per_rank: list[dict[str, Any]], n: int, previous: list[int] | None
) -> dict[str, Any]:
    """Figures from what the ranks received in one epoch."""
    ids = [i for r in per_rank for i in r["ids"]]
    counts = Counter(ids)
    order = [i for r in per_rank for i in r["ids"]]
    draws = [d for r in per_rank for d in r["draws"]]
    return {
        "samples/rank": [len(r["ids"]) for r in per_rank],
        "batches/rank": [len(r["sizes"]) for r in per_rank],
        "duplicates": sum(c - 1 for c in counts.values()),
        "missing": n - len(counts),
        "partial batches/rank": [sum(s < r["batch_size"] for s in r["sizes"]) for r in per_rank],
        "order changed": None if previous is None else order != previous,
        "repeated draws": len(draws) - len(set(draws)),
        "_order": order,
    }


def run_epochs(
    loader: tud.DataLoader[Any], model: nn.Module, epochs: int, n: int, batch_size: int
) -> list[dict[str, Any]]:
    optimiser = torch.optim.SGD(model.parameters(), lr=0.01)
    reports, previous = [], None
    for _epoch in range(epochs):
        received: dict[str, Any] = {"ids": [], "sizes": [], "draws": [], "batch_size": batch_size}
        for batch in loader:
            loss = nn.functional.mse_loss(model(batch["x"]), batch["y"])
            optimiser.zero_grad()
            loss.backward()  # DDP all-reduces here: a rank with an extra batch would hang
            optimiser.step()
            received["ids"] += batch["id"].tolist()
            received["draws"] += batch["draw"].tolist()
            received["sizes"].append(len(batch["id"]))
        report = epoch_report(gather(received), n, previous)
        previous = report.pop("_order")
        report["loss"] = float(loss.detach())
        reports.append(report)
    return reports


def check(reports: list[dict[str, Any]]) -> list[str]:
    """The guarantees, checked on what was received; returns what failed."""
    failed = []
    for e, r in enumerate(reports):
        if r["duplicates"] or r["missing"]:
            failed.append(f"epoch {e}: not exactly once")
        if len(set(r["batches/rank"])) != 1:
            failed.append(f"epoch {e}: unequal batch counts")
        if max(r["partial batches/rank"]) > 1:
            failed.append(f"epoch {e}: more than one partial batch per rank")
        if r["order changed"] is False:
            failed.append(f"epoch {e}: same order as the previous epoch")
        if r["repeated draws"]:
            failed.append(f"epoch {e}: augmentation draws repeated")
    return failed


def show(title: str, reports: list[dict[str, Any]]) -> None:
    print(f"\n== {title}")
    keys = [k for k in reports[0] if k != "loss"]
    width = max(map(len, keys)) + 2
    print(" " * width + "".join(f"epoch {e:<14}" for e in range(len(reports))))
    for key in [*keys, "loss"]:
        cells = "".join(f"{_fmt(r[key]):<20}" for r in reports)
        print(f"{key:<{width}}{cells}")


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4f}"
    return str(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args(argv)

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Linear(FEATURES, 1))

    ds = evenly.Dataset(Generated(args.samples), shuffle=True, seed=0, transform=augment)
    loader = evenly.DataLoader(ds, batch_size=args.batch_size, num_workers=args.workers)
    ours = run_epochs(loader, model, args.epochs, args.samples, args.batch_size)

    # persistent workers here too: like evenly.DataLoader, fork the workers once rather
    # than right after each epoch's last all_reduce (see RELIABILITY.md, fork and gloo)
    naive_loader = tud.DataLoader(
        Naive(args.samples),
        batch_size=args.batch_size,
        num_workers=args.workers,
        persistent_workers=args.workers > 0,
    )
    naive = run_epochs(naive_loader, model, args.epochs, args.samples, args.batch_size)

    code = 0
    if rank == 0:
        print(
            f"evenly demo: DDP on {world} ranks (gloo, CPU) x {args.workers} DataLoader workers, "
            f"{args.samples} generated samples, batch {args.batch_size}, {args.epochs} epochs"
        )
        show("evenly.Dataset + evenly.DataLoader (shuffle=True)", ours)
        show("naive IterableDataset + torch DataLoader (the talk's first attempt)", naive)
        failed = check(ours)
        print("\nevenly guarantees on what training received:", "HOLD" if not failed else "BROKEN")
        for line in failed:
            print("  FAILED:", line)
        print(f"naive loader problems: {len(check(naive))} (as expected)")
        code = 1 if failed else 0
    dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())
