"""Where ``s3://`` is read with obstore, the main process lists the shards (and reads the
manifest beside them) in a helper process (issue 28): it never imports s3fs, nor starts
obstore's runtime (its forked DataLoader workers still read with obstore), before the
first batch or at a later pass start.  A real S3-compatible server (moto's, on 127.0.0.1)
behind ``tests/s3proxy.py``; each check runs in a fresh interpreter, so that what the
test process itself imported does not count.  No mock of fsspec or S3."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import evenly
import evenly.sources as es
from evenly.sources import _manifest
from tests import s3server
from tests.s3proxy import S3Proxy
from tests.s3server import S3Endpoint

pytest.importorskip("obstore")
s3 = s3server.s3  # the fixtures: a real moto server and a fresh key prefix per test
s3_prefix = s3server.s3_prefix
SHARDS, PER_SHARD = 8, 16
N = SHARDS * PER_SHARD

_CHILD = textwrap.dedent(
    """
    import json, sys
    import evenly, evenly.sources as es
    from evenly.sources import _obstore

    url, fmt, options, cache_dir = json.loads(sys.argv[1])
    out = {}

    def state(name):
        out[name] = {
            "s3fs": "s3fs" in sys.modules,
            "botocore": "botocore" in sys.modules,
            "obstore_ran": _obstore._STARTED_IN,
        }

    if fmt == "error":
        try:
            es.from_parquet(url, storage_options=options, cache_dir=cache_dir)
        except Exception as exc:
            out["error"] = [type(exc).__name__, str(exc)]
        state("after error")
    else:
        read = es.from_parquet if fmt == "parquet" else es.from_webdataset
        src = read(url, storage_options=options, cache_dir=cache_dir)
        state("open")
        ds = evenly.Dataset(src, shuffle="block", seed=5, block_shards=2)
        loader = evenly.DataLoader(
            ds, batch_size=16, num_workers=2, collate_fn=list, timeout=60,
            multiprocessing_context="fork",
        )
        for epoch in (0, 1):
            batches = iter(loader)
            seen = [int(s["id"]) for s in next(batches)]
            state(f"first batch {epoch}")
            print(json.dumps({"first": epoch}), flush=True)
            sys.stdin.readline()  # the test reads the proxy's counters
            seen += [int(s["id"]) for b in batches for s in b]
            out[f"seen {epoch}"] = seen
    print(json.dumps(out), flush=True)
    """
)


@pytest.fixture
def proxy(s3: S3Endpoint) -> Iterator[S3Proxy]:
    with S3Proxy(s3.endpoint_url, delay=0.01) as p:
        yield p


def via(s3: S3Endpoint, proxy: S3Proxy) -> dict[str, Any]:
    return {**s3.storage_options, "client_kwargs": {"endpoint_url": proxy.url}}


def upload(s3: S3Endpoint, prefix: str, tmp_path: Path, fmt: str) -> str:
    rows = ({"__key__": f"k{i:04d}", "id": str(i), "bin": bytes(64)} for i in range(N))
    local = tmp_path / "local"
    if fmt == "parquet":
        rows = ({"id": r["id"], "bin": r["bin"]} for r in rows)
    es.write(rows, local, format=fmt, rows_per_shard=PER_SHARD, progress=False)
    return s3.upload(str(local), prefix)


def child(args: list[Any]) -> subprocess.Popen[str]:
    env = {**os.environ, "EVENLY_OBSTORE": "1"}
    return subprocess.Popen(
        [sys.executable, "-c", _CHILD, json.dumps(args)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )


def answer(proc: subprocess.Popen[str]) -> dict[str, Any]:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, f"the child exited {proc.wait(timeout=60)}"
    data: dict[str, Any] = json.loads(line)
    return data


@pytest.mark.parametrize("creds", ["given", "environment"])
@pytest.mark.parametrize("fmt", ["parquet", "webdataset"])
def test_no_s3fs_in_the_main_process_before_the_first_batch_nor_at_the_next_pass(
    s3: S3Endpoint, s3_prefix: str, proxy: S3Proxy, tmp_path: Path, fmt: str, creds: str
) -> None:
    """A fresh process opens a remote directory (obstore chosen) and reads two epochs
    with 2 forked workers: when each first batch is yielded, ``s3fs`` is not in its
    ``sys.modules`` and obstore's runtime never ran in it (the workers read with obstore);
    one listing per open and per later pass start; each epoch exactly once.  Before:
    the open listed with s3fs (imported, about 0.7 s of the first batch)."""
    url = upload(s3, s3_prefix, tmp_path, fmt)
    proxy.reset_stats()
    options = via(s3, proxy)
    if creds == "environment":  # $AWS_ACCESS_KEY_ID and the rest, as s3server sets them
        options = {k: v for k, v in options.items() if k not in ("key", "secret")}
    proc = child([url, fmt, options, str(tmp_path / "c")])
    try:
        assert answer(proc) == {"first": 0}
        assert proxy.stats()["listings"] == 1  # the open's; the first pass uses it
        agents = proxy.stats()["agents"]
        proxy.reset_stats()
        assert proc.stdin is not None
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert answer(proc) == {"first": 1}
        assert proxy.stats()["listings"] == 1  # the second pass start's
        proc.stdin.write("\n")
        proc.stdin.flush()
        out = answer(proc)
    finally:
        proc.kill()
        proc.communicate(timeout=60)  # and closes its pipes
    # $AWS_DEFAULT_REGION set (s3server), the key and secret given or in the environment
    # with no profile named: no botocore either (before: imported for the region and,
    # without a key in the options, for the credentials)
    clean = {"s3fs": False, "botocore": False, "obstore_ran": None}
    assert out["open"] == out["first batch 0"] == out["first batch 1"] == clean, out
    clients = {c for per_key in agents.values() for c in per_key}
    assert clients == {"object_store"}, agents  # the workers read with obstore
    for epoch in (0, 1):
        assert sorted(out[f"seen {epoch}"]) == list(range(N))  # exactly once


@pytest.mark.parametrize("fault", ["missing prefix", "forbidden"])
def test_a_listing_error_is_raised_in_the_main_process_naming_the_url(
    s3: S3Endpoint, s3_prefix: str, proxy: S3Proxy, tmp_path: Path, fault: str
) -> None:
    """A prefix with no object, or credentials refused (403 on the listing): the error of
    the helper process is raised where the source is opened, of the type the fsspec path
    raises, naming the URL, and s3fs is still not imported there."""
    url = upload(s3, s3_prefix, tmp_path, "parquet")
    if fault == "missing prefix":
        url, kind = f"s3://{s3.bucket}/{s3_prefix}-nothing", "FileNotFoundError"
    else:
        proxy.fault("forbidden", match="list-type")
        kind = "PermissionError"
    proc = child([url, "error", via(s3, proxy), str(tmp_path / "c")])
    try:
        out = answer(proc)
    finally:
        proc.kill()
        proc.communicate(timeout=60)  # and closes its pipes
    assert out["error"][0] == kind, out
    assert url.removeprefix("s3://") in out["error"][1], out
    assert out["after error"] == {"s3fs": False, "botocore": False, "obstore_ran": None}, out


def test_the_helper_listing_is_the_fsspec_one(
    s3: S3Endpoint, s3_prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The helper process (obstore) and fsspec list the same shards, in the same order,
    with the same fingerprints (size and ETag) and sizes, and the manifest beside them is
    used (nothing scanned): a directory with a subdirectory and hidden files, a
    ``.parquet``-named directory, one object, and an explicit list; then ``relist``
    agrees too.  Before: there was no helper (``Shards.fs`` was s3fs)."""
    url = upload(s3, s3_prefix, tmp_path, "parquet")
    fs = s3.fs()
    base = url.removeprefix("s3://")
    fs.copy(f"{base}/shard-00001.parquet", f"{base}/sub/x.parquet")
    fs.copy(f"{base}/shard-00002.parquet", f"{base}/_hidden/y.parquet")
    fs.copy(f"{base}/shard-00003.parquet", f"{base}-dir.parquet/part-0.parquet")
    cases: list[Any] = [
        url,
        f"{url}/",
        f"{url}-dir.parquet",
        f"{url}/shard-00004.parquet",
        [f"{url}/shard-00005.parquet", f"{url}/sub/x.parquet", f"{url}/shard-00000.parquet"],
    ]
    for case in cases:
        listed = []
        for flag in ("0", "1"):
            monkeypatch.setenv("EVENLY_OBSTORE", flag)
            shards = _manifest.resolve(case, (".parquet",), s3.storage_options, what="t")
            listed.append((shards.urls, shards.fingerprints, shards.sizes))
            assert (shards.fs is None) == (flag == "1") and shards.remote
        assert listed[0] == listed[1], case
        assert _manifest.relist(shards) == list(shards.fingerprints)
    monkeypatch.setenv("EVENLY_OBSTORE", "1")

    def no_scan(k: int, url: str) -> tuple[int, dict[str, Any]]:
        raise AssertionError(f"scanned {url}: the manifest beside it was not used")

    shards = _manifest.resolve(url, (".parquet",), s3.storage_options, what="t")
    assert shards.manifests is not None
    assert shards.manifests[f"{url}/.evenly-manifest.json"] is not None
    assert shards.manifests[f"{url}/sub/.evenly-manifest.json"] is None  # listed: none
    plain = _manifest.Shards(
        shards.fs,
        shards.urls[:SHARDS],
        shards.fingerprints[:SHARDS],
        shards.storage_options,
        shards.sizes[:SHARDS],
        shards.manifests,
    )
    entries = _manifest.load_entries(plain, "parquet", no_scan, cache_dir=str(tmp_path / "m"))
    assert sum(e.num_rows for e in entries) == N


def test_a_stalled_listing_stops_the_helper_and_names_the_url(
    s3: S3Endpoint, s3_prefix: str, proxy: S3Proxy, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A listing that stalls (headers, then no byte, with a read timeout longer than the
    helper's time): the helper process is stopped after ``_lister.TIMEOUT`` and the open
    raises naming the URL, never a hang.  Before: no helper (s3fs listed in-process)."""
    from evenly.sources import _lister

    url = upload(s3, s3_prefix, tmp_path, "parquet")
    monkeypatch.setenv("EVENLY_OBSTORE", "1")
    monkeypatch.setattr(_lister, "TIMEOUT", 3.0)
    proxy.fault("stall", match="list-type", times=None, at=0, seconds=60)
    options = {**via(s3, proxy), "config_kwargs": {"read_timeout": 60}}
    stopped = rf"listing {re.escape(url)}: .*helper process was stopped"
    with pytest.raises(TimeoutError, match=stopped):
        es.from_parquet(url, storage_options=options, cache_dir=str(tmp_path / "c"))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_the_helpers_retries_are_counted_at_the_open_and_in_the_pass_that_listed(
    s3: S3Endpoint,
    s3_prefix: str,
    proxy: S3Proxy,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    num_workers: int,
) -> None:
    """A 503 SlowDown on the open's listing and a connection reset on the listing of the
    next pass start, each retried with the shard cache's policy and counted where the
    cache counts its own retries: the open's by the helper process, which says so in its
    answer (logged and counted in the source's ``io_stats()``); the pass start's by the
    cache (a new helper run), in that pass's ``loader.stats()``; each epoch exactly
    once.  Before: the helper retried, but no count reached the main process (0 both)."""
    url = upload(s3, s3_prefix, tmp_path, "parquet")
    monkeypatch.setenv("EVENLY_OBSTORE", "1")
    proxy.fault("status", match="list-type", status=503)
    with caplog.at_level(logging.WARNING, logger="evenly"):
        src = es.from_parquet(url, storage_options=via(s3, proxy), cache_dir=str(tmp_path / "c"))
    assert src.io_stats()["fetch_retries"] == 1
    assert f"listing retried a request: ConnectionError: {url}" in caplog.text
    assert "HTTP 503 SlowDown" in caplog.text
    loader = evenly.DataLoader(
        evenly.Dataset(src, shuffle="block", seed=5, block_shards=2),
        batch_size=16,
        num_workers=num_workers,
        collate_fn=list,
        timeout=60 if num_workers else 0,
        multiprocessing_context="fork" if num_workers else None,
    )
    first = [int(s["id"]) for b in loader for s in b]  # the open's listing serves it
    assert sorted(first) == list(range(N))
    assert loader.stats().last.fetch_retries == 0
    proxy.fault("reset", match="list-type")  # the next pass start lists again
    second = [int(s["id"]) for b in loader for s in b]
    assert sorted(second) == list(range(N))
    assert loader.stats().last.fetch_retries == 1  # the listing's retry (shards cached)
    assert proxy.stats()["listings"] == 4  # two tries at the open, two at the second pass


def test_a_helper_that_dies_falls_back_to_fsspec_with_the_same_shards(
    s3: S3Endpoint,
    s3_prefix: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The helper process dies without an answer (here the interpreter it is run with
    is a program that prints a crash and exits 1): the open and a pass start's listing
    are done with fsspec instead, with the same shards, fingerprints and sizes, and one
    log line says why; the source reads every sample.  Before: untested (this passes
    on main; it fails if the crash is not caught as a fallback)."""
    url = upload(s3, s3_prefix, tmp_path, "parquet")
    monkeypatch.setenv("EVENLY_OBSTORE", "1")
    helped = _manifest.resolve(url, (".parquet",), s3.storage_options, what="t")
    assert helped.fs is None  # listed by the helper
    dead = tmp_path / "python"
    dead.write_text("#!/bin/sh\necho 'Fatal Python error: Segmentation fault' >&2\nexit 1\n")
    dead.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(dead))
    with caplog.at_level(logging.WARNING, logger="evenly"):
        fell = _manifest.resolve(url, (".parquet",), s3.storage_options, what="t")
        now = _manifest.relist(helped)  # a pass start's listing of the helper's shards
    assert fell.fs is not None  # listed by fsspec (s3fs)
    assert (fell.urls, fell.fingerprints, fell.sizes) == (
        helped.urls,
        helped.fingerprints,
        helped.sizes,
    )
    assert now == list(helped.fingerprints)
    why = "listing helper process failed (exit 1): Fatal Python error: Segmentation fault"
    assert caplog.text.count(why) == 2, caplog.text
    src = es.from_parquet(url, storage_options=s3.storage_options, cache_dir=str(tmp_path / "c"))
    assert sorted(int(src[i]["id"]) for i in range(len(src))) == list(range(N))


def test_a_listing_that_keeps_failing_at_a_pass_start_is_tried_as_the_cache_retries(
    s3: S3Endpoint, s3_prefix: str, proxy: S3Proxy, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every listing after the open answers 503: the pass start tries it 1 + ``retries``
    times in all (the shard cache's policy, one loop), then raises a ``ConnectionError``
    in the main process naming the source and the tries.  Before: the helper's own loop
    ran inside the cache's, 4 x 5 = 20 listings."""
    url = upload(s3, s3_prefix, tmp_path, "parquet")
    monkeypatch.setenv("EVENLY_OBSTORE", "1")
    src = es.from_parquet(url, storage_options=via(s3, proxy), cache_dir=str(tmp_path / "c"))
    src._fresh_listing = None  # the first pass start lists too
    assert src.cache is not None
    retries = src.cache.retries  # 4 by default
    proxy.reset_stats()
    proxy.fault("status", match="list-type", status=503, times=None)
    loader = evenly.DataLoader(evenly.Dataset(src, seed=5), batch_size=16, collate_fn=list)
    source = "cannot list the shards of evenly.from_parquet: "
    tries = rf"{source}.*{re.escape(url)}.*503.*after {retries + 1} tries"
    with pytest.raises(ConnectionError, match=tries):
        iter(loader)
    assert proxy.stats()["listings"] == retries + 1


_WORKER_IMPORTS = textwrap.dedent(
    """
    import json, os, sys
    main, out = os.getpid(), sys.argv[2]
    LAZY = ("numpy.random", "numpy.ma")

    def note(event, args):  # inherited by the forked workers
        if event == "import" and args[0] in LAZY and args[0] not in sys.modules:
            where = "main" if os.getpid() == main else "worker"
            open(os.path.join(out, f"{where}-{args[0]}"), "w").close()

    sys.addaudithook(note)
    import evenly, evenly.sources as es

    url, fmt, options, cache_dir = json.loads(sys.argv[1])
    read = es.from_parquet if fmt == "parquet" else es.from_webdataset
    src = read(url, storage_options=options, cache_dir=cache_dir)
    opened = sorted(os.listdir(out))
    loader = evenly.DataLoader(
        evenly.Dataset(src, shuffle="block", seed=5, block_shards=2), batch_size=16,
        num_workers=2, collate_fn=list, timeout=60, multiprocessing_context="fork",
    )
    seen = [int(s["id"]) for b in loader for s in b]
    print(json.dumps({"opened": opened, "epoch": sorted(os.listdir(out)), "seen": seen}))
    """
)


@pytest.mark.parametrize("fmt", ["parquet", "webdataset"])
def test_forked_workers_import_nothing_of_numpy_the_open_could_import_while_the_helper_lists(
    s3: S3Endpoint, s3_prefix: str, proxy: S3Proxy, tmp_path: Path, fmt: str
) -> None:
    """A fresh process opens a remote directory (listed by the helper) and reads an epoch
    with 2 forked workers: ``numpy.random`` (torch seeds it in every worker) and
    ``numpy.ma`` (``np.unique`` loads it) were imported by the open, while the helper
    listed, and by no worker after its fork (an audit hook, inherited by the workers,
    notes where each was imported); the epoch exactly once.  Before: each worker
    imported both after its fork, 40-120 ms before its first request (bench_remote)."""
    url = upload(s3, s3_prefix, tmp_path, fmt)
    notes = tmp_path / "imports"
    notes.mkdir()
    args = json.dumps([url, fmt, via(s3, proxy), str(tmp_path / "c")])
    done = subprocess.run(
        [sys.executable, "-c", _WORKER_IMPORTS, args, str(notes)],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "EVENLY_OBSTORE": "1"},
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["opened"] == ["main-numpy.ma", "main-numpy.random"], out
    assert out["epoch"] == out["opened"], out  # no worker imported either
    assert sorted(out["seen"]) == list(range(N))


def test_what_the_open_does_meanwhile_runs_while_the_helper_lists_and_an_error_stops_it(
    s3: S3Endpoint, s3_prefix: str, tmp_path: Path
) -> None:
    """``_lister.run(meanwhile=...)``: the callable runs after the request was sent, while
    the helper process is alive (it is this process's child then), and the answer is the
    same listing; an error raised by it stops the helper (no process left) and reaches
    the caller.  Before: no ``meanwhile`` (the open waited idle for the helper)."""
    import psutil

    from evenly.sources import _lister, _obstore

    url = upload(s3, s3_prefix, tmp_path, "parquet")
    options = _obstore.resolved_options(s3.storage_options)
    request = {"op": "resolve", "items": [url], "extensions": [".parquet"], "options": options}
    request["what"] = "test"
    helpers: list[psutil.Process] = []

    def meanwhile() -> None:
        children = psutil.Process().children()
        helpers.extend(c for c in children if _lister.__file__ in " ".join(c.cmdline()))

    got = _lister.run(request, url, meanwhile=meanwhile)
    assert len(helpers) == 1, helpers
    assert len(got["items"]) == SHARDS  # the shards, as without it
    assert not helpers[0].is_running()  # reaped

    def fails() -> None:
        meanwhile()
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _lister.run(request, url, meanwhile=fails)
    assert len(helpers) == 2, helpers
    assert not helpers[1].is_running()
