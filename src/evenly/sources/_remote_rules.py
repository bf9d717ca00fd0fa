"""The rules the package and the ``s3://`` listing helper share: which listed files are
shards, the name of the manifest beside them, and the retry policy of a request to the
storage (which errors are transient, the backoff, the loop).

Standard library only: the helper (``python _lister.py``) loads this file by its path,
as it loads ``_obstore.py``, and must not import evenly's package (numpy, pyarrow) nor
torch.

>>> is_shard("d/a.parquet", "a.parquet", (".parquet",)), hidden("_tmp/a.parquet")
(True, True)
>>> is_shard("d/.x/a.parquet", ".x/a.parquet", (".parquet",))
False
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import TypeVar

__all__ = [
    "BACKOFF",
    "MANIFEST_NAME",
    "MAX_BACKOFF_TOTAL",
    "RETRIES",
    "hidden",
    "is_shard",
    "is_transient",
    "retrying",
]

T = TypeVar("T")

#: the manifest ``evenly.write`` leaves beside the shards (see ``_manifest``)
MANIFEST_NAME = ".evenly-manifest.json"
#: further tries of a request after a transient error (``ShardCache(retries=)``'s default)
RETRIES = 4
#: seconds before the first retry, doubled for each next one, with jitter
#: (``ShardCache(backoff=)``'s default)
BACKOFF = 0.5
#: the longest one request waits in backoff sleeps, whatever ``retries`` says
MAX_BACKOFF_TOTAL = 60.0

# exception class names (anywhere in the chain) that mean "try again": botocore,
# aiohttp, urllib3, http.client, fsspec; matched by name so none has to be installed
_TRANSIENT_NAMES = frozenset(
    {
        "EndpointConnectionError",
        "ConnectionClosedError",
        "ConnectTimeoutError",
        "ReadTimeoutError",
        "ResponseStreamingError",
        "IncompleteReadError",
        "ClientConnectionError",
        "ClientPayloadError",
        "ServerDisconnectedError",
        "ServerTimeoutError",
        "FSTimeoutError",
        "ProtocolError",
        "IncompleteRead",
        "RemoteDisconnected",
    }
)
_TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestLimitExceeded",
        "TooManyRequestsException",
        "RequestTimeout",
        "InternalError",
        "ServiceUnavailable",
    }
)


def hidden(relative: str) -> bool:
    """Skipped in a directory, as pyarrow does: a part starting with '.' or '_'."""
    return any(part.startswith((".", "_")) for part in relative.split("/"))


def is_shard(name: str, relative: str, extensions: tuple[str, ...]) -> bool:
    """Whether a file listed in a directory is one of its shards: ``name`` ends in one of
    ``extensions`` and no part of its path ``relative`` to the directory is hidden."""
    return name.endswith(extensions) and not hidden(relative)


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it was raised from) is worth retrying: a
    connection or timeout error, HTTP 5xx or 429, or an S3 throttling code."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, FileNotFoundError | PermissionError | IsADirectoryError):
            return False
        if isinstance(e, ConnectionError | TimeoutError):
            return True
        if any(c.__name__ in _TRANSIENT_NAMES for c in type(e).__mro__):
            return True
        response = getattr(e, "response", None)
        if isinstance(response, dict):
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            code = response.get("Error", {}).get("Code")
            if (isinstance(status, int) and (status >= 500 or status == 429)) or (
                code in _TRANSIENT_CODES
            ):
                return True
        e = e.__cause__ or e.__context__
    return False


def retrying(
    call: Callable[[], T],
    *,
    retries: int = RETRIES,
    backoff: float = BACKOFF,
    on_retry: Callable[[int, float, Exception], None] | None = None,
    give_up: Callable[[Exception, int, float], BaseException] | None = None,
) -> T:
    """``call()``, tried again after a transient error (:func:`is_transient`): at most
    ``retries`` more tries, ``backoff`` seconds before the first, doubling, with jitter,
    at most :data:`MAX_BACKOFF_TOTAL` seconds of sleeps in all.  ``on_retry(tries,
    delay, error)`` before each sleep (log, count: one retry); after the last try,
    ``give_up(error, tries, seconds)`` is raised from the error (else the error itself).
    Any other error is raised at once."""
    started = time.monotonic()
    slept = 0.0
    attempt = 0
    while True:
        try:
            return call()
        except Exception as exc:
            if not is_transient(exc):
                raise
            delay = backoff * 2**attempt * random.uniform(0.5, 1.0)
            if attempt == retries or slept + delay > MAX_BACKOFF_TOTAL:
                if give_up is None:
                    raise
                raise give_up(exc, attempt + 1, time.monotonic() - started) from exc
            if on_retry is not None:
                on_retry(attempt + 1, delay, exc)
            time.sleep(delay)
            slept += delay
            attempt += 1
