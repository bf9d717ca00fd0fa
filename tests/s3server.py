"""A real S3-compatible server on 127.0.0.1 (moto's server mode) for the source tests.

Import the fixtures into a test module::

    from tests.s3server import s3, s3_prefix  # noqa: F401

``s3`` (session scope) starts ``moto.server.ThreadedMotoServer`` on a free port, sets
dummy AWS credentials, creates a bucket and yields an :class:`S3Endpoint`; tests reach
it through fsspec/s3fs with ``endpoint.storage_options``.  No mock of fsspec or s3.

``fetch_path`` runs a test on both clients that read ``s3://`` objects: fsspec (s3fs)
and obstore (``$EVENLY_OBSTORE``; skipped where obstore is not installed).

If ``EVENLY_TEST_S3_ENDPOINT`` is set (e.g. by .ci/run, to a ``moto_server`` it started
on 127.0.0.1), that server is used instead of starting one.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SECURITY_TOKEN": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@dataclass(frozen=True)
class S3Endpoint:
    endpoint_url: str
    bucket: str

    @property
    def storage_options(self) -> dict[str, Any]:
        return {
            "key": _ENV["AWS_ACCESS_KEY_ID"],
            "secret": _ENV["AWS_SECRET_ACCESS_KEY"],
            "client_kwargs": {"endpoint_url": self.endpoint_url},
            "skip_instance_cache": True,
        }

    def fs(self) -> Any:
        import s3fs

        return s3fs.S3FileSystem(**self.storage_options)

    def upload(self, local_dir: str, prefix: str) -> str:
        """Copy the files of ``local_dir`` (hidden ones included) to ``s3://bucket/prefix/``."""
        fs = self.fs()
        for name in sorted(os.listdir(local_dir)):
            path = os.path.join(local_dir, name)
            if os.path.isfile(path):
                fs.put_file(path, f"{self.bucket}/{prefix}/{name}")
        return f"s3://{self.bucket}/{prefix}"


@pytest.fixture(scope="session")
def s3() -> Iterator[S3Endpoint]:
    pytest.importorskip("s3fs")
    from moto.server import ThreadedMotoServer

    with pytest.MonkeyPatch.context() as mp:
        for name, value in _ENV.items():
            mp.setenv(name, value)
        for name in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):
            mp.delenv(name, raising=False)
        external = os.environ.get("EVENLY_TEST_S3_ENDPOINT")
        server = None
        if external is None:
            server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
            server.start()
        try:
            if server is not None:
                host, port = server.get_host_and_port()
                external = f"http://{host}:{port}"
            endpoint = S3Endpoint(external, f"evenly-test-{uuid.uuid4().hex[:8]}")
            endpoint.fs().mkdir(endpoint.bucket)
            yield endpoint
        finally:
            if server is not None:
                server.stop()


@pytest.fixture
def s3_prefix() -> str:
    """A fresh key prefix, so tests never see each other's objects."""
    return f"t-{uuid.uuid4().hex[:12]}"


@pytest.fixture(params=["fsspec", "obstore"])
def fetch_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The client that reads ``s3://`` objects in this test (and the processes it starts):
    ``$EVENLY_OBSTORE`` set to 0 or 1."""
    if request.param == "obstore":
        pytest.importorskip("obstore")
    monkeypatch.setenv("EVENLY_OBSTORE", "1" if request.param == "obstore" else "0")
    return str(request.param)


#: the client each fetch path's requests name in their User-Agent (``S3Proxy.stats()``)
AGENTS = {"fsspec": "botocore", "obstore": "object_store"}


def worker_context(fetch_path: str) -> str | None:
    """DataLoader workers' start method for ``fetch_path``: obstore's runtime does not
    survive a fork (this test process may have started it), so its workers start from
    the fork server; fsspec's keep the default (fork)."""
    return "forkserver" if fetch_path == "obstore" else None
