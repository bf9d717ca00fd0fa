"""The shard cache against a real S3-compatible server (moto's server mode): downloads
left by a SIGKILLed process are counted and removed, a download whose size differs from
the listing is refused, a server that is down for a moment is survived by the retry (and
one that stays down is named), remote shards are scanned in parallel and once, and no
``fcntl`` is needed to import or use the cache."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from filelock import FileLock

import evenly.sources as es
from evenly.sources._cache import ShardCache, is_transient
from evenly.sources._jsonl import JsonlSource
from evenly.sources._webdataset import WebDatasetSource
from tests import s3server
from tests.s3server import S3Endpoint

s3 = s3server.s3  # the fixtures: a real moto server and a fresh key prefix per test
s3_prefix = s3server.s3_prefix


def shard_files(cache: ShardCache) -> list[str]:
    """What the cache dir holds besides lock files."""
    return sorted(n for n in os.listdir(cache.cache_dir) if not n.endswith(".lock"))


# ---- downloads left by a killed process --------------------------------------------
def _download(cache_dir: str, options: dict[str, Any], url: str) -> None:
    ShardCache(cache_dir, 1 << 30, options).fetch(url)


def _part_in_flight(cache_dir: Path, proc: Any) -> Path | None:
    """Poll until the child's ``.part-`` file holds some bytes (None if it finished)."""
    shards = cache_dir / "shards"
    while proc.is_alive():
        parts = list(shards.glob("*.part-*")) if shards.exists() else []
        if parts and parts[0].stat().st_size > 0:
            return parts[0]
        time.sleep(0.001)  # let the in-process server send
    return None


def test_a_killed_download_leaves_a_part_file_that_is_counted_and_removed(
    s3: S3Endpoint, s3_prefix: str, tmp_path: Path
) -> None:
    size = 16 << 20
    s3.fs().pipe_file(f"{s3.bucket}/{s3_prefix}/big.bin", os.urandom(size))
    url = f"s3://{s3.bucket}/{s3_prefix}/big.bin"
    ctx = mp.get_context("fork")
    for attempt in range(3):  # the kill must land mid-download
        cache_dir = tmp_path / f"c{attempt}"
        proc = ctx.Process(target=_download, args=(str(cache_dir), s3.storage_options, url))
        proc.start()
        part = _part_in_flight(cache_dir, proc)
        os.kill(proc.pid, signal.SIGKILL)
        proc.join()
        if part is not None and part.exists():
            break
    else:
        pytest.fail("the download always finished before it could be killed")
    assert proc.exitcode == -signal.SIGKILL
    cache = ShardCache(str(cache_dir), 1 << 30, s3.storage_options)  # the next process
    left = part.stat().st_size
    assert 0 < left <= size and cache.usage() == left  # counted against the bound
    assert cache.evict() == [str(part)] and cache.usage() == 0  # its lock is free: removed
    assert os.path.getsize(cache.fetch(url, "", size)) == size
    assert [n for n in shard_files(cache) if ".part-" in n] == []


def test_a_running_download_is_counted_but_never_removed(tmp_path: Path) -> None:
    cache = ShardCache(str(tmp_path), max_bytes=10)
    target = cache.path_for("s3://bucket/shard.tar", "fp")
    os.makedirs(cache.cache_dir)
    part = f"{target}.part-{os.getpid()}-0123abcd"
    Path(part).write_bytes(b"x" * 100)
    with FileLock(target + ".lock"):  # held by the downloader for the whole download
        assert cache.usage() == 100
        assert cache.evict() == [] and os.path.exists(part)
    assert cache.evict() == [part] and cache.usage() == 0


# ---- a download whose size is not the listed one -----------------------------------
def test_a_download_of_another_size_than_listed_raises_and_caches_nothing(
    s3: S3Endpoint, s3_prefix: str, tmp_path: Path
) -> None:
    local = tmp_path / "local"
    es.write([{"id": i} for i in range(8)], local, format="jsonl", rows_per_shard=4)
    url = s3.upload(str(local), s3_prefix)
    src = es.from_jsonl(url, storage_options=s3.storage_options, cache_dir=str(tmp_path / "c"))
    assert src.cache is not None and src.cache.downloads == 0  # opened from the manifest
    shard = f"{url}/shard-00001.jsonl"
    listed = (local / "shard-00001.jsonl").stat().st_size
    changed = b"".join(b'{"id": %d}\n' % (10 * i) for i in range(5))
    s3.fs().pipe_file(shard, changed)
    # s3fs reads the listed version (If-Match) and fails on the new one; a store that
    # tells the size first fails on that
    match = (
        rf"cannot read sample 5 \({re.escape(shard)} row 1\): ValueError: (the download of "
        rf"{re.escape(shard)} has {len(changed)} bytes but the listing said {listed}|"
        rf"{re.escape(shard)} changed since the dataset was opened)"
    )
    with pytest.raises(ValueError, match=match):
        src[5]
    assert shard_files(src.cache) == []  # neither the file nor a .part left behind
    assert src[1] == {"id": 1}  # the unchanged shard still reads


# ---- transient errors ----------------------------------------------------------------
@pytest.fixture
def own_server(s3: S3Endpoint) -> Iterator[dict[str, Any]]:
    """A moto server of this test's own (so it can be stopped), with an object on it."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    options = {
        **s3.storage_options,
        "client_kwargs": {"endpoint_url": f"http://{host}:{port}"},
        "config_kwargs": {"retries": {"max_attempts": 1}},  # no botocore retries: ours
    }
    bucket = f"evenly-retry-{uuid.uuid4().hex[:8]}"
    import s3fs

    fs = s3fs.S3FileSystem(**options)
    fs.mkdir(bucket)
    payload = os.urandom(4096)
    fs.pipe_file(f"{bucket}/x.bin", payload)
    servers = [server]
    try:
        yield {
            "url": f"s3://{bucket}/x.bin",
            "payload": payload,
            "options": options,
            "port": port,
            "servers": servers,
        }
    finally:
        for s in servers:
            s.stop()


class _RestartOnRetry(logging.Handler):
    """Brings the server back up when the cache logs its first retry."""

    def __init__(self, port: int, servers: list[Any]) -> None:
        super().__init__()
        self.port, self.servers, self.retries = port, servers, 0

    def emit(self, record: logging.LogRecord) -> None:
        if "retrying the download" not in record.getMessage():
            return
        self.retries += 1
        if self.retries == 1:
            from moto.server import ThreadedMotoServer

            server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
            server.start()
            self.servers.append(server)


def test_a_server_down_for_a_moment_is_survived_by_the_retry(
    own_server: dict[str, Any], tmp_path: Path
) -> None:
    own_server["servers"][0].stop()  # down...
    handler = _RestartOnRetry(own_server["port"], own_server["servers"])
    logging.getLogger("evenly").addHandler(handler)
    try:
        cache = ShardCache(str(tmp_path), 1 << 30, own_server["options"], backoff=0.05)
        path = cache.fetch(own_server["url"], "", len(own_server["payload"]))
    finally:
        logging.getLogger("evenly").removeHandler(handler)
    assert handler.retries == 1  # ...and up again for the second try
    assert Path(path).read_bytes() == own_server["payload"] and cache.downloads == 1


def test_a_server_that_stays_down_is_named_after_the_retries(
    own_server: dict[str, Any], tmp_path: Path
) -> None:
    own_server["servers"][0].stop()
    cache = ShardCache(str(tmp_path), 1 << 30, own_server["options"], retries=2, backoff=0.01)
    url = own_server["url"]
    with pytest.raises(ConnectionError, match=rf"cannot download {re.escape(url)}: .*3 tries"):
        cache.fetch(url)
    assert shard_files(cache) == []


def test_throttling_and_5xx_are_retried_but_not_missing_or_forbidden_objects() -> None:
    from botocore.exceptions import ClientError, EndpointConnectionError, ReadTimeoutError
    from s3fs.errors import translate_boto_error  # as s3fs raises them

    def s3_error(code: str, status: int) -> BaseException:
        response: Any = {
            "Error": {"Code": code, "Message": code},
            "ResponseMetadata": {"HTTPStatusCode": status},
        }
        return translate_boto_error(ClientError(response, "GetObject"))

    for code, status in [("SlowDown", 503), ("InternalError", 500), ("Throttling", 400)]:
        assert is_transient(s3_error(code, status)), code
    for code, status in [("NoSuchKey", 404), ("AccessDenied", 403), ("InvalidRange", 416)]:
        assert not is_transient(s3_error(code, status)), code
    assert is_transient(EndpointConnectionError(endpoint_url="http://127.0.0.1:1"))
    assert is_transient(ReadTimeoutError(endpoint_url="http://127.0.0.1:1"))
    assert not is_transient(ValueError("the download has 3 bytes but the listing said 4"))


# ---- parallel scans at open ----------------------------------------------------------
@pytest.mark.parametrize(("fmt", "cls"), [("jsonl", JsonlSource), ("webdataset", WebDatasetSource)])
def test_remote_shards_are_scanned_in_parallel_and_once(
    s3: S3Endpoint,
    s3_prefix: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    fmt: str,
    cls: Any,
) -> None:
    rows = [{"__key__": f"k{i:03d}", "id": i} for i in range(32)]
    es.write(rows, tmp_path / "local", format=fmt, rows_per_shard=8, progress=False)
    url = s3.upload(str(tmp_path / "local"), f"{s3_prefix}/{fmt}")
    s3.fs().rm(f"{url}/.evenly-manifest.json")  # so the first open must scan
    real = cls._scan
    both = threading.Barrier(2, timeout=30)  # sequential scans would never pass it
    lock = threading.Lock()
    state = {"active": 0, "peak": 0, "scans": 0}

    def scan(self: Any, k: int, u: str) -> tuple[int, dict[str, Any]]:
        with lock:
            state["active"] += 1
            state["scans"] += 1
            state["peak"] = max(state["peak"], state["active"])
        try:
            if k < 2:
                both.wait()  # shards 0 and 1 are being scanned at the same time
            return real(self, k, u)
        finally:
            with lock:
                state["active"] -= 1

    monkeypatch.setattr(cls, "_scan", scan)
    read = es.from_jsonl if fmt == "jsonl" else es.from_webdataset
    options: dict[str, Any] = {"storage_options": s3.storage_options, "cache_dir": str(tmp_path)}
    src = read(url, **options)
    assert state["peak"] >= 2 and state["scans"] == 4
    again = read(url, **options)
    assert state["scans"] == 4  # the cached manifest: nothing scanned...
    assert again.cache is not None and again.cache.downloads == 0  # ...nor downloaded
    assert [int(s["id"]) for s in src.__getitems__([0, 9, 31])] == [0, 9, 31]


# ---- no fcntl ------------------------------------------------------------------------
def test_the_cache_needs_no_fcntl(tmp_path: Path) -> None:
    (tmp_path / "x.bin").write_bytes(b"abc")
    code = (
        "import sys; sys.modules['fcntl'] = None\n"  # as on a platform without it
        "import evenly, evenly.sources\n"
        "from evenly.sources._cache import ShardCache\n"
        f"c = ShardCache({str(tmp_path / 'c')!r}, 1 << 20)\n"
        f"p = c.fetch('file://' + {str(tmp_path / 'x.bin')!r}, 'fp', 3)\n"
        "print(open(p, 'rb').read().decode(), c.usage())\n"
    )
    out = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["abc", "3"]
