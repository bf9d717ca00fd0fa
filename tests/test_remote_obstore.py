"""obstore as the client for ``s3://`` reads (``$EVENLY_OBSTORE``): how s3fs's
``storage_options`` map to it, what is refused and how, and a DataLoader worker forked
after its parent read with obstore (whose runtime does not survive a fork) reading with
s3fs instead of hanging.  The remote tests that take ``fetch_path`` (tests/test_fetch.py,
test_remote_faults.py, test_remote_global.py, test_remote_identity.py) run every other
behaviour on both clients against moto's server on 127.0.0.1."""

from __future__ import annotations

import re
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

import evenly
import evenly.sources as es
from evenly.sources._cache import ShardCache
from evenly.sources._manifest import with_timeouts
from evenly.sources._obstore import s3_options
from tests import s3server
from tests.s3proxy import S3Proxy
from tests.s3server import S3Endpoint
from tests.sources_helpers import as_list

s3 = s3server.s3  # the fixtures: a real moto server and a fresh key prefix per test
s3_prefix = s3server.s3_prefix
fetch_path = s3server.fetch_path  # fsspec (s3fs) or obstore


def clients(proxy: S3Proxy) -> dict[str, int]:
    """GETs of objects per client (User-Agent product) that the proxy received."""
    out: dict[str, int] = {}
    for by in proxy.stats()["agents"].values():
        for client, n in by.items():
            out[client] = out.get(client, 0) + n
    return out


def test_s3fs_storage_options_map_to_obstore_and_the_rest_is_named() -> None:
    options = with_timeouts(
        "s3://b/d",
        {
            "key": "K",
            "secret": "S",
            "token": "T",
            "client_kwargs": {"endpoint_url": "http://127.0.0.1:9", "region_name": "eu-west-3"},
            "config_kwargs": {"retries": {}, "s3": {"addressing_style": "virtual"}},
            "skip_instance_cache": True,
            "requester_pays": True,
        },
    )
    kwargs, why = s3_options(options)
    assert why == "" and kwargs is not None
    assert kwargs["credentials"] == {"key": "K", "secret": "S", "token": "T"}
    assert (kwargs["endpoint"], kwargs["region"]) == ("http://127.0.0.1:9", "eu-west-3")
    assert kwargs["virtual_hosted_style_request"] is True and kwargs["request_payer"] is True
    assert kwargs["client_options"] == {
        "read_timeout": timedelta(seconds=20),  # evenly's stall timeout, as for s3fs
        "connect_timeout": timedelta(seconds=10),
        "allow_http": True,
    }
    assert s3_options({"anon": True})[0] == {"credentials": {"anon": True}}
    for bad, named in [
        ({"session": object()}, "storage_options['session']"),
        ({"s3_additional_kwargs": {"SSECustomerKey": "k"}}, "s3_additional_kwargs"),
        ({"client_kwargs": {"proxies": {}}}, "storage_options['client_kwargs']['proxies']"),
        ({"config_kwargs": {"signature_version": "s3"}}, "['signature_version']"),
        ({"use_ssl": False}, "storage_options['use_ssl']=False"),
    ]:
        kwargs, why = s3_options(bad)
        assert kwargs is None and named in why, (bad, why)


def test_obstore_on_refuses_options_it_cannot_map_naming_them_when_the_source_opens(
    s3: S3Endpoint, s3_prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("obstore")
    rows = [{"id": i} for i in range(8)]
    es.write(rows, tmp_path / "local", format="jsonl", rows_per_shard=4, progress=False)
    url = s3.upload(str(tmp_path / "local"), s3_prefix)
    options = {**s3.storage_options, "s3_additional_kwargs": {"SSECustomerAlgorithm": "AES256"}}
    monkeypatch.setenv("EVENLY_OBSTORE", "1")
    refused = r"\$EVENLY_OBSTORE=1 but s3:// cannot be read with obstore: .*s3_additional_kwargs"
    with pytest.raises(ValueError, match=refused):
        es.from_jsonl(url, storage_options=options, cache_dir=str(tmp_path / "c"))
    monkeypatch.setenv("EVENLY_OBSTORE", "yes")
    with pytest.raises(ValueError, match=re.escape("$EVENLY_OBSTORE='yes': set it to 1")):
        es.from_jsonl(url, storage_options=s3.storage_options, cache_dir=str(tmp_path / "c"))
    monkeypatch.setenv("EVENLY_OBSTORE", "0")  # fsspec: the same options read
    src = es.from_jsonl(url, storage_options=options, cache_dir=str(tmp_path / "c"))
    assert sorted(int(src[i]["id"]) for i in range(8)) == list(range(8))


def test_a_worker_forked_after_its_parent_read_with_obstore_reads_with_s3fs_not_hanging(
    s3: S3Endpoint, s3_prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The main process reads a sample (obstore's runtime starts in it), then a loader
    forks 2 workers: they read the other shards with s3fs, and the epoch is exactly once."""
    pytest.importorskip("obstore")
    monkeypatch.setenv("EVENLY_OBSTORE", "1")
    n, per = 48, 12
    rows = [{"id": i} for i in range(n)]
    es.write(rows, tmp_path / "l", format="parquet", rows_per_shard=per, progress=False)
    url = s3.upload(str(tmp_path / "l"), s3_prefix)
    with S3Proxy(s3.endpoint_url) as proxy:
        options: dict[str, Any] = {
            **s3.storage_options,
            "client_kwargs": {"endpoint_url": proxy.url},
        }
        src = es.from_parquet(url, storage_options=options, cache_dir=str(tmp_path / "c"))
        proxy.reset_stats()  # the listing and the manifest are read with s3fs
        assert int(src[0]["id"]) == 0  # shard 0, downloaded here with obstore
        assert clients(proxy) == {"object_store": 1}
        ds = evenly.Dataset(src, shuffle=True, seed=5, block_shards=2)
        loader = evenly.DataLoader(
            ds,
            batch_size=4,
            num_workers=2,
            collate_fn=as_list,
            timeout=120,  # a hang fails the test
            multiprocessing_context="fork",
        )
        ids = sorted(int(s["id"]) for batch in loader for s in batch)
        agents = clients(proxy)
    assert ids == list(range(n))
    assert agents["object_store"] == 1 and agents["botocore"] == n // per - 1, agents


def test_shard_cache_reads_with_the_chosen_client(
    s3: S3Endpoint, s3_prefix: str, tmp_path: Path, fetch_path: str
) -> None:
    """``$EVENLY_OBSTORE`` chooses the client of every GET (its User-Agent at the proxy),
    the listed version checked either way."""
    key = f"{s3.bucket}/{s3_prefix}/x.bin"
    s3.fs().pipe_file(key, b"x" * 1000)
    etag = s3.fs().info(key)["ETag"]
    with S3Proxy(s3.endpoint_url) as proxy:
        options = {**s3.storage_options, "client_kwargs": {"endpoint_url": proxy.url}}
        cache = ShardCache(str(tmp_path / "c"), 1 << 20, options, url=f"s3://{key}")
        assert Path(cache.fetch(f"s3://{key}", f"1000:{etag}", 1000)).read_bytes() == b"x" * 1000
        with pytest.raises(ValueError, match=re.escape(f"s3://{key}") + " changed"):
            cache.fetch(f"s3://{key}", '1000:"another"', 1000)
        assert set(clients(proxy)) == {s3server.AGENTS[fetch_path]}
