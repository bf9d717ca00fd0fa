"""A ``cache_dir`` that cannot be written (a file in its path, a read-only mount, a full
disk) is named, with the setting to change: the decoded-row cache turns itself off with an
``EvenlyWarning`` (reading without it is always correct); packing's lengths cache raises a
clear error instead of numpy's ``OSError: 100000 requested and 64512 written``.

The read-only mount and the full disk are real: a tmpfs mounted in a private mount
namespace (``unshare -m``), which needs root (CI runs as root)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import evenly
import evenly.sources as es
from evenly.errors import EvenlyWarning
from tests.sources_helpers import as_list

ROWS, GROUP = 2000, 100  # 20 row groups of ~27 KB decoded: more than a 256 KiB tmpfs
ROOT = Path(__file__).resolve().parents[1]


def payload(i: int) -> bytes:
    return i.to_bytes(4, "little") * 64  # 256 bytes, one per id


def write_data(out: Path) -> Path:
    rows = [{"id": i, "payload": payload(i)} for i in range(ROWS)]
    es.write(rows, out, rows_per_shard=1000, row_group_size=GROUP, progress=False)
    return out


def read_all(src: Any, workers: int) -> list[dict[str, Any]]:
    ds = evenly.Dataset(src, shuffle=True, seed=0, rank=0, world_size=1)
    loader = evenly.DataLoader(
        ds, batch_size=16, num_workers=workers, collate_fn=as_list, timeout=60 if workers else 0
    )
    return [r for batch in loader for r in batch]


def check(rows: list[dict[str, Any]]) -> None:
    assert sorted(r["id"] for r in rows) == list(range(ROWS))
    assert all(r["payload"] == payload(r["id"]) for r in rows)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_file_in_the_cache_dir_path_turns_the_row_cache_off_naming_it(
    tmp_path: Path, workers: int
) -> None:
    """It stopped with a bare ``NotADirectoryError``."""
    data = write_data(tmp_path / "data")
    (tmp_path / "afile").write_text("not a directory")
    with pytest.warns(EvenlyWarning) as said:
        src = es.from_parquet(data, cache_dir=str(tmp_path / "afile" / "cache"))
    (message,) = [str(w.message) for w in said]
    assert f"{tmp_path / 'afile'} is a file, not a directory" in message
    assert "decoded-row cache is off" in message and "pass cache_dir=" in message
    assert src.decoded_cache is None
    check(read_all(src, workers))


# ---- a real read-only mount and a real full disk -------------------------------------------
def _can_mount() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"],
        capture_output=True,
        timeout=30,
    )
    return probe.returncode == 0


needs_mount = pytest.mark.skipif(
    not _can_mount(), reason="needs root and unshare -m (a private tmpfs mount)"
)

_READ = """
import json, sys, warnings
import evenly.sources as es
from evenly.errors import EvenlyWarning
from tests.test_cache_dir_faults import ROWS, payload, read_all

data, cache, workers = sys.argv[1], sys.argv[2] or None, int(sys.argv[3])
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    src = es.from_parquet(data, cache_dir=cache)
    rows = read_all(src, 0) if workers == 0 else None
if rows is None:  # the workers' warnings go to stderr (Python's default filters)
    rows = read_all(src, workers)
ok = sorted(r["id"] for r in rows) == list(range(ROWS))
ok = ok and all(r["payload"] == payload(r["id"]) for r in rows)
said = [str(w.message) for w in caught if issubclass(w.category, EvenlyWarning)]
print(json.dumps({"ok": ok, "warnings": said, "cache_on": src.decoded_cache is not None}))
"""


def in_tmpfs(
    mnt: Path, setup: list[str], script: str, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``python -c script *args`` in a private mount namespace where ``mnt`` is a 256 KiB
    tmpfs, after the shell commands ``setup``."""
    mnt.mkdir(exist_ok=True)
    steps = [f"mount -t tmpfs -o size=256k tmpfs {mnt}", *setup, 'exec "$0" "$@"']
    return subprocess.run(
        ["unshare", "-m", "sh", "-c", " && ".join(steps), sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
    )


def result(run: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert run.returncode == 0, run.stderr[-3000:]
    out: dict[str, Any] = json.loads(run.stdout.strip().splitlines()[-1])
    return out


@needs_mount
@pytest.mark.parametrize("how", ["cache_dir", "EVENLY_CACHE_DIR"])
def test_a_read_only_cache_dir_turns_the_row_cache_off_naming_the_setting(
    tmp_path: Path, how: str
) -> None:
    """It stopped with a bare ``OSError: [Errno 30] Read-only file system``."""
    data = write_data(tmp_path / "data")
    mnt = tmp_path / "ro"
    cache = str(mnt / "cache")
    run = in_tmpfs(
        mnt,
        [f"mount -o remount,ro {mnt}"],
        _READ,
        str(data),
        cache if how == "cache_dir" else "",
        "0",
        env={"EVENLY_CACHE_DIR": cache},
    )
    out = result(run)
    assert out["ok"] and not out["cache_on"]
    (message,) = out["warnings"]
    assert f"{mnt} is on a read-only file system" in message
    assert "decoded-row cache is off" in message
    if how == "cache_dir":
        assert "pass cache_dir=" in message
    else:
        assert f"set $EVENLY_CACHE_DIR (now {cache!r})" in message


@needs_mount
def test_a_cache_dir_made_read_only_after_its_first_use_turns_the_row_cache_off(
    tmp_path: Path,
) -> None:
    data = write_data(tmp_path / "data")
    mnt = tmp_path / "ro"
    setup = [f"mkdir -p {mnt}/cache/rows", f"mount -o remount,ro {mnt}"]
    out = result(in_tmpfs(mnt, setup, _READ, str(data), str(mnt / "cache"), "0"))
    assert out["ok"] and not out["cache_on"]
    (message,) = out["warnings"]
    assert f"{mnt}/cache/rows is on a read-only file system" in message


@needs_mount
@pytest.mark.parametrize("workers", [0, 2])
def test_a_full_disk_stops_the_row_cache_writing_naming_decoded_cache_bytes(
    tmp_path: Path, workers: int
) -> None:
    """It was a log line per row group; the cache now stops writing in the process that
    met the full disk, with one warning naming the disk, ``decoded_cache_bytes`` and
    ``cache_dir``; every row still right."""
    data = write_data(tmp_path / "data")
    mnt = tmp_path / "full"
    run = in_tmpfs(mnt, [], _READ, str(data), str(mnt / "cache"), str(workers))
    out = result(run)
    assert out["ok"] and out["cache_on"]
    said = out["warnings"] if not workers else run.stderr.split("EvenlyWarning: ")[1:]
    assert 1 <= len(said) <= max(workers, 1), said  # once per process that met it
    assert "the decoded-row cache stops writing in this process" in said[0]
    assert f"the disk holding {mnt}/cache/rows is full" in said[0]
    assert "decoded_cache_bytes (or $EVENLY_DECODED_CACHE_BYTES) is 16384 MiB" in said[0]
    assert "pass cache_dir=" in said[0]


_LENGTHS = """
import sys
import evenly, evenly.sources as es
src = es.from_parquet(sys.argv[1], decoded_cache_bytes=0)
ds = evenly.Dataset(src, shuffle=True, seed=0, rank=0, world_size=1, pack=evenly.Packing(8))
try:
    next(iter(evenly.DataLoader(ds, batch_size=4)))
except OSError as exc:
    print(type(exc).__name__, exc)
"""


@needs_mount
def test_packings_lengths_cache_on_a_full_disk_names_evenly_cache_dir(tmp_path: Path) -> None:
    """It was numpy's bare ``OSError: 100000 requested and 64512 written``."""
    data = tmp_path / "tokens"
    data.mkdir()
    ids = pa.array([[1, 2, 3]] * 100_000, pa.list_(pa.int32()))
    pq.write_table(pa.table({"input_ids": ids}), data / "a.parquet", row_group_size=10_000)
    mnt = tmp_path / "full"
    run = in_tmpfs(mnt, [], _LENGTHS, str(data), env={"EVENLY_CACHE_DIR": str(mnt / "c")})
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"the disk holding {mnt}/c/lengths is full" in run.stdout, run.stdout
    assert f"set $EVENLY_CACHE_DIR (now '{mnt}/c')" in run.stdout


_LISTING = """
import json, os, sys
import evenly.sources as es
src = es.from_parquet(sys.argv[1], cache_dir=sys.argv[2])
folder = os.path.join(sys.argv[2], "manifests")
print(json.dumps({"rows": len(src), "left": os.listdir(folder) if os.path.isdir(folder) else []}))
"""


@needs_mount
def test_a_full_disk_leaves_no_temp_file_of_the_shards_listing(tmp_path: Path) -> None:
    """The shards' scanned listing could not be written (the disk is full): the source
    still opens and reads, and its temporary file is removed, not left behind."""
    data = tmp_path / "many"
    data.mkdir()
    for k in range(300):
        pq.write_table(pa.table({"id": [k]}), data / f"part-{k:04d}.parquet")
    mnt = tmp_path / "full"
    fill = [f"mkdir -p {mnt}/cache/manifests", f"dd if=/dev/zero of={mnt}/fill bs=4k count=62"]
    out = result(in_tmpfs(mnt, fill, _LISTING, str(data), str(mnt / "cache")))
    assert out == {"rows": 300, "left": []}
