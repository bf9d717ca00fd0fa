"""What the side-by-side benchmarks share: running each contender in a fresh subprocess
while sampling the memory of its process tree, the child's end-of-epoch report, and the
table (median [min, max] over interleaved rounds).

Memory is PSS summed over the process tree (``/proc/<pid>/smaps_rollup``): RSS counts a
page shared by forked workers or memory-mapped from the page cache once per process, PSS
splits it between them.  It is reported split in two, each part's peak over the run:
non-reclaimable (``Pss_Anon + Pss_Shmem``: heap, private copies, shared memory) and
file-backed (``Pss_File``: clean page cache the kernel can drop and read again).
Bytes read are the ``read(2)`` bytes (``/proc/<pid>/io`` ``rchar``) of the loader's
worker processes during the timed epoch: reads through a memory map (Arrow IPC, numpy
memmap) do not count there.

>>> summary([3.0, 1.0, 2.0])
(2.0, 1.0, 3.0)
>>> same_shard_rate(np.array([0, 1, 5, 6, 2]), per_shard=4)
0.5
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "Row",
    "child_mark",
    "child_report",
    "env_for",
    "fmt_ratio",
    "import_streaming",
    "importable",
    "print_goals",
    "print_table",
    "run_child",
    "same_shard_rate",
    "summary",
    "worker_read_chars",
]


def summary(values: Sequence[float]) -> tuple[float, float, float]:
    """(median, min, max) of the values."""
    return statistics.median(values), min(values), max(values)


def same_shard_rate(ids: np.ndarray, per_shard: int) -> float:
    """How often two consecutive samples of the epoch come from the same shard (a
    perfect shuffle over S equal shards gives about 1/S; reading shard by shard, ~1)."""
    if ids.size < 2:
        return 0.0
    shard = ids // per_shard
    return float(np.mean(shard[1:] == shard[:-1]))


def worker_read_chars(own: bool = False) -> int:
    """``rchar`` summed over this process's live children (the loader's workers), or with
    ``own`` this process's (the reader threads of ``worker_type="thread"``)."""
    import psutil

    if own:
        return int(psutil.Process().io_counters().read_chars)
    total = 0
    for p in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            total += int(p.io_counters().read_chars)
    return total


def child_report(
    ids: Sequence[np.ndarray], seconds: float, num_samples: int, per_shard: int, read: int | None
) -> None:
    """Print the child's result as the last line of stdout (JSON)."""
    order = np.concatenate(ids) if ids else np.zeros(0, np.int64)
    unique = np.unique(order)
    print(
        json.dumps(
            {
                "samples": int(order.size),
                "seconds": seconds,
                "missing": int(num_samples - unique.size),
                "repeated": int(order.size - unique.size),
                "same_shard": same_shard_rate(order, per_shard),
                "read_bytes": read,
            }
        )
    )


def importable(module: str) -> bool:
    try:
        import_streaming() if module == "streaming" else __import__(module)
        return True
    except Exception:
        return False


def import_streaming() -> Any:
    """Import mosaicml-streaming without torchvision: its ``streaming.vision`` subpackage
    imports torchvision at import time; the bench needs none of it."""
    import types

    sys.modules.setdefault("streaming.vision", types.ModuleType("streaming.vision"))
    import streaming

    return streaming


PSS_FIELDS = ("Pss_Anon", "Pss_Shmem", "Pss_File")


def smaps_pss(pid: int) -> dict[str, int]:
    """``Pss``, ``Pss_Anon``, ``Pss_Shmem`` and ``Pss_File`` of one process, in bytes."""
    out = dict.fromkeys(("Pss", *PSS_FIELDS), 0)
    with open(f"/proc/{pid}/smaps_rollup", encoding="ascii") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name in out:
                out[name] = int(rest.split()[0]) * 1024
    return out


def _tree_pss(root: Any) -> tuple[int, int]:
    """(non-reclaimable, file-backed) PSS summed over the process tree."""
    import psutil

    anon = file = 0
    for p in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.Error, OSError):
            m = smaps_pss(p.pid)
            anon += m["Pss_Anon"] + m["Pss_Shmem"]
            file += m["Pss_File"]
    return anon, file


MARK = "#mark "


def child_mark(name: str) -> None:
    """In a child run with ``on_mark``: tell the parent that ``name`` was reached, and wait
    until it has taken what it measures there (e.g. a proxy's byte counters)."""
    sys.stdout.write(f"{MARK}{name}\n")
    sys.stdout.flush()
    sys.stdin.readline()


def _communicate_marks(
    proc: subprocess.Popen[str], timeout: float, on_mark: Callable[[str], None]
) -> tuple[str, str]:
    """``proc.communicate`` that answers the child's ``child_mark`` lines as they come."""
    stdout, stdin, stderr = proc.stdout, proc.stdin, proc.stderr
    if stdout is None or stdin is None or stderr is None:
        raise ValueError("run the child with stdin, stdout and stderr piped")
    err: list[str] = []
    reader = threading.Thread(target=lambda: err.append(stderr.read()), daemon=True)
    reader.start()
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    out: list[str] = []
    try:
        for line in stdout:
            if line.startswith(MARK):
                on_mark(line[len(MARK) :].strip())
                with contextlib.suppress(OSError):
                    stdin.write("\n")
                    stdin.flush()
            else:
                out.append(line)
        proc.wait()
    finally:
        expired = not timer.is_alive()
        timer.cancel()
        reader.join()
    if expired and proc.returncode != 0:
        raise subprocess.TimeoutExpired(proc.args, timeout)
    return "".join(out), "".join(err)


def run_child(
    cmd: list[str],
    env: dict[str, str],
    timeout: float,
    on_mark: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run one contender; its JSON result plus the peaks of the tree's PSS (bytes):
    ``peak_pss`` (total), ``peak_anon`` (anonymous + shared memory), ``peak_file``
    (file-backed); or ``{"error"}``.  With ``on_mark``, each ``child_mark(name)`` of the
    child calls ``on_mark(name)`` in the parent while the child waits."""
    import psutil

    proc = subprocess.Popen(
        cmd,
        stdin=subprocess.PIPE if on_mark else None,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    peak = peak_anon = peak_file = 0
    done = threading.Event()

    def sample() -> None:
        nonlocal peak, peak_anon, peak_file
        try:
            root = psutil.Process(proc.pid)
        except psutil.Error:
            return
        while not done.is_set():
            try:
                anon, file = _tree_pss(root)
            except psutil.Error:
                break
            peak, peak_anon = max(peak, anon + file), max(peak_anon, anon)
            peak_file = max(peak_file, file)
            done.wait(0.1)

    watcher = threading.Thread(target=sample, daemon=True)
    watcher.start()
    try:
        if on_mark is None:
            out, err = proc.communicate(timeout=timeout)
        else:
            out, err = _communicate_marks(proc, timeout, on_mark)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return {"error": f"timed out after {timeout:.0f} s"}
    finally:
        done.set()
        watcher.join()
    if proc.returncode != 0:
        lines = [x for x in err.strip().splitlines() if x.strip()]
        # the exception's line, not a trailing line of a printed structure
        raised = [x for x in lines if x.split(":")[0].strip().endswith(("Error", "Exception"))]
        last = (raised or lines)[-1][:160] if lines else f"exit {proc.returncode}"
        return {"error": last}
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    result.update(peak_pss=peak, peak_anon=peak_anon, peak_file=peak_file)
    return result


@dataclass
class Row:
    """One contender's runs, and the rows its ratios are taken against."""

    name: str
    workload: str
    runs: list[dict[str, Any]] = field(default_factory=list)
    refs: tuple[tuple[str, str], ...] = ()  # (label, key of the reference row)
    note: str = ""

    @property
    def error(self) -> str | None:
        return next((r["error"] for r in self.runs if "error" in r), None)

    def rates(self) -> list[float]:
        return [r["samples"] / r["seconds"] for r in self.runs if "error" not in r]

    def rate(self) -> float | None:
        rates = self.rates()
        return statistics.median(rates) if rates and self.error is None else None

    def worst(self, key: str) -> Any:
        values = [r[key] for r in self.runs if r.get(key) is not None]
        return max(values) if values else None


def fmt_ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def print_table(title: str, rows: Iterable[Row], by_name: dict[str, Row]) -> None:
    """One workload's table: samples/s median [min-max], ratios, peak PSS (total, and
    its non-reclaimable and file-backed parts), MB read, missing/repeated ids and the
    same-shard neighbour rate."""
    print(f"\n## {title}")
    head = (
        f"{'contender':<26} {'samples/s median [min-max]':>31} {'ratios':<41} "
        f"{'PSS MiB':>8} {'anon+shm':>8} {'file':>6} {'MB read':>8} {'miss/rep':>9} "
        f"{'same-shard':>10}"
    )
    print(head)
    print("-" * len(head))
    for row in rows:
        if row.error is not None:
            print(f"{row.name:<26} failed: {row.error}")
            continue
        med, lo, hi = summary(row.rates())
        rate = f"{med:>9,.0f} [{lo:,.0f}-{hi:,.0f}]"
        ratios = " ".join(
            f"{fmt_ratio(med, by_name[key].rate())} {label}"
            for label, key in row.refs
            if key in by_name
        )
        read = row.worst("read_bytes")
        mb = "-" if read is None else f"{read / 1e6:,.0f}"
        pss = row.worst("peak_pss") / 2**20
        anon, file = row.worst("peak_anon") / 2**20, row.worst("peak_file") / 2**20
        miss = f"{row.worst('missing')}/{row.worst('repeated')}"
        same = statistics.median(r["same_shard"] for r in row.runs)
        print(
            f"{row.name:<26} {rate:>31} {ratios:<41} {pss:>8,.0f} {anon:>8,.0f} {file:>6,.0f} "
            f"{mb:>8} {miss:>9} {same:>10.4f}{'  ' + row.note if row.note else ''}"
        )


def print_goals(
    goals: Iterable[tuple[str, str, float, str, str, str]], rows: dict[str, Row]
) -> None:
    """Each goal (what, ">=" or "<=", goal, row, reference row, "rate" or a run field
    such as "peak_pss") as the ratio of this run's figures, met or not."""
    print("\n## goals (ratios of this run's medians; PSS: peak over the rounds)")
    for what, op, goal, key, ref, figure in goals:
        value = None
        if key in rows and ref in rows:
            a, b = (
                (rows[key].rate(), rows[ref].rate())
                if figure == "rate"
                else (rows[key].worst(figure), rows[ref].worst(figure))
            )
            value = a / b if a and b else None
        if value is None:
            print(f"{what:<56} {op} {goal:<5} -")
            continue
        met = value >= goal if op == ">=" else value <= goal
        print(f"{what:<56} {op} {goal:<5} {value:6.2f}x  {'met' if met else 'NOT met'}")


def env_for(data_dir: str) -> dict[str, str]:
    return {
        **os.environ,
        "EVENLY_BENCH_DATA": data_dir,
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONWARNINGS": "ignore",
    }
