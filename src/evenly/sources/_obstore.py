"""obstore's S3 client for reading ``s3://`` objects: the shard cache's downloads (whole
objects and range parts) and the global shuffle's range reads.

Which path reads an object (with obstore, the main process's listing and manifest are
read by a helper process: ``_lister``):

- ``$EVENLY_OBSTORE=0``: fsspec (s3fs) always.
- ``$EVENLY_OBSTORE=1``: obstore for ``s3://``; an error naming the setting if obstore is
  not installed or the ``storage_options`` cannot be mapped to it.
- unset (the default): :data:`DEFAULT` says (obstore, where it is installed and the
  options map onto it; else fsspec, with one log line saying why).

The ``storage_options`` (s3fs's) map to an ``S3Store`` built from them alone: ``key``,
``secret``, ``token`` (or ``username``/``password``, or ``client_kwargs``'
``aws_access_key_id``...), ``anon``, ``endpoint_url`` (top level or in
``client_kwargs``; ``http://`` allowed), ``region_name``, ``requester_pays``,
``client_kwargs={"verify": False}``, ``config_kwargs``' ``read_timeout`` (the stall
timeout: no byte for that long fails the read), ``connect_timeout``, ``region_name``,
``s3={"addressing_style": ...}`` and ``signature_version=UNSIGNED``; ``profile`` or no
credentials at all: botocore's credential chain (as s3fs), refreshed when they expire.
Options that only tune s3fs (caches, block sizes, ``config_kwargs``' retries and pool
size) are ignored; any other option is refused (``$EVENLY_OBSTORE=1``) or read through
fsspec with one log line saying which.

obstore is not fork-safe: a process forked after its runtime started (a DataLoader worker
forked from a main process that read with obstore) would hang on its first request, so
such a process reads with fsspec (one log line says so); a process that never used
obstore before forking (the usual main process: its listing is a helper process's,
Parquet footers are fsspec's) leaves its workers free to use it, and so do spawned
processes.

obstore's own retries are off: evenly's retry policy (the shard cache's) retries and
counts every transient error.  Errors come out as the fsspec path's: a missing object
``FileNotFoundError``; HTTP 401/403 a ``PermissionError`` (never retried); a failed
``If-Match`` :class:`VersionChanged`; HTTP 5xx, 429, a connection reset, a short body or a
stalled read a ``ConnectionError`` (retried); each naming the URL.

>>> kw, why = s3_options({"key": "k", "client_kwargs": {"endpoint_url": "http://h:9"}})
>>> kw["endpoint"], kw["client_options"], kw["credentials"], why
('http://h:9', {'allow_http': True}, {'key': 'k'}, '')
>>> s3_options({"session": object()})[1]
"storage_options['session'] (a botocore session object)"
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from collections.abc import Callable, Mapping
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from obstore.store import ClientConfig, S3Credential, S3Store

__all__ = [
    "DEFAULT",
    "ENV",
    "ObjectStore",
    "VersionChanged",
    "chosen",
    "listed_etag",
    "s3_options",
    "store_for",
]

logger = logging.getLogger("evenly")

#: the environment variable that chooses the path: ``0`` fsspec, ``1`` obstore
ENV = "EVENLY_OBSTORE"
#: whether ``s3://`` objects are read with obstore when it is installed and ``$EVENLY_OBSTORE``
#: is unset: yes, by measurement (``bench/bench_remote.py``: cold epochs 1.34x s3fs's with
#: the block shuffle, 2.3x with the global shuffle by range; docs/formats.md)
DEFAULT = True
#: the longest one request may take (obstore's default, 30 s, would cut a large part on
#: a slow shared link); a stall is caught by the read timeout instead
_REQUEST_TIMEOUT = timedelta(hours=1)
#: s3fs options that only tune s3fs itself: nothing to map
_IGNORED = frozenset(
    {
        "skip_instance_cache",
        "use_listings_cache",
        "listings_expiry_time",
        "max_paths",
        "default_block_size",
        "default_fill_cache",
        "default_cache_type",
        "cache_regions",
        "version_aware",
        "max_concurrency",
        "fixed_upload_size",
        "loop",
        "asynchronous",
    }
)
_CLIENT_KEYS = {
    "aws_access_key_id": "key",
    "aws_secret_access_key": "secret",
    "aws_session_token": "token",
}
_CONFIG_IGNORED = frozenset({"retries", "max_pool_connections", "tcp_keepalive"})
_STATUS = re.compile(r"status code: (\d{3})")
_CODE = re.compile(r"<Code>([^<]+)</Code>")
_TRANSIENT_WORDS = ("body error", "error sending request", "connect", "timed out", "timeout")


class VersionChanged(Exception):
    """The object is not the version listed (an ``If-Match`` failed): the caller raises
    its "changed since the dataset was opened" error naming the URL."""


def s3_options(options: Mapping[str, Any]) -> tuple[dict[str, Any] | None, str]:
    """``S3Store`` keyword arguments for s3fs ``options`` (credentials aside: see
    :func:`_credentials`), or None and the option that cannot be mapped."""
    config: dict[str, Any] = {}
    client: dict[str, Any] = {}
    creds: dict[str, Any] = {}
    for name, value in options.items():
        if name in _IGNORED:
            continue
        if name in ("key", "username", "secret", "password", "token"):
            creds[{"username": "key", "password": "secret"}.get(name, name)] = value
        elif name == "anon":
            creds["anon"] = bool(value)
        elif name == "profile":
            creds["profile"] = value
        elif name == "endpoint_url":
            config["endpoint"] = value
        elif name == "requester_pays":
            config["request_payer"] = bool(value)
        elif name == "use_ssl":
            if not value:
                return None, "storage_options['use_ssl']=False"
        elif name == "s3_additional_kwargs":
            if value:
                return None, f"storage_options['s3_additional_kwargs']={value!r}"
        elif name == "client_kwargs":
            for key, v in dict(value or {}).items():
                if key == "endpoint_url":
                    config["endpoint"] = v
                elif key == "region_name":
                    config["region"] = v
                elif key in _CLIENT_KEYS:
                    creds[_CLIENT_KEYS[key]] = v
                elif key == "verify" and v is False:
                    client["allow_invalid_certificates"] = True
                elif key != "verify" or v is not True:
                    return None, f"storage_options['client_kwargs'][{key!r}]"
        elif name == "config_kwargs":
            for key, v in dict(value or {}).items():
                if key == "read_timeout":
                    client["read_timeout"] = timedelta(seconds=float(v))
                elif key == "connect_timeout":
                    client["connect_timeout"] = timedelta(seconds=float(v))
                elif key == "region_name":
                    config["region"] = v
                elif key == "signature_version" and str(v) == "UNSIGNED":
                    creds["anon"] = True
                elif key == "s3" and set(dict(v)) <= {"addressing_style"}:
                    style = dict(v).get("addressing_style", "auto")
                    config["virtual_hosted_style_request"] = style == "virtual"
                elif key not in _CONFIG_IGNORED:
                    return None, f"storage_options['config_kwargs'][{key!r}]"
        elif name == "session":
            return None, "storage_options['session'] (a botocore session object)"
        else:
            return None, f"storage_options[{name!r}]"
    if str(config.get("endpoint", "")).startswith("http://"):
        client["allow_http"] = True
    out: dict[str, Any] = dict(config)
    if client:
        out["client_options"] = client
    if creds:
        out["credentials"] = creds
    return out, ""


def _credentials(creds: Mapping[str, Any]) -> tuple[Callable[[], S3Credential] | None, str]:
    """A credential provider as s3fs would sign with: the given key and secret (a token
    only if given: none from the environment mixed in), else botocore's chain (the
    environment, ``profile``, config files, instance roles), re-asked when they expire;
    its first place, ``$AWS_ACCESS_KEY_ID`` / ``$AWS_SECRET_ACCESS_KEY`` (and
    ``$AWS_SESSION_TOKEN``) with no ``profile`` named, is read without botocore.
    None with ``anon``; a reason when botocore finds none."""
    if creds.get("anon"):
        return None, ""
    if creds.get("key") and creds.get("secret"):
        static: S3Credential = {
            "access_key_id": str(creds["key"]),
            "secret_access_key": str(creds["secret"]),
            "token": str(creds["token"]) if creds.get("token") else None,
            "expires_at": None,
        }
        return (lambda: static), ""
    environ = os.environ
    if (
        not creds.get("profile")
        and environ.get("AWS_ACCESS_KEY_ID")
        and environ.get("AWS_SECRET_ACCESS_KEY")
        and not environ.get("AWS_CREDENTIAL_EXPIRATION")
    ):  # botocore's first place (no profile named), read without importing it (~0.2 s)
        token = environ.get("AWS_SESSION_TOKEN") or environ.get("AWS_SECURITY_TOKEN")
        from_env: S3Credential = {
            "access_key_id": environ["AWS_ACCESS_KEY_ID"],
            "secret_access_key": environ["AWS_SECRET_ACCESS_KEY"],
            "token": token or None,
            "expires_at": None,
        }
        return (lambda: from_env), ""
    import botocore.session

    session = botocore.session.Session(profile=creds.get("profile"))
    found = session.get_credentials()
    if found is None:
        return None, "no credentials found by botocore (nor key/secret in storage_options)"

    def provide() -> S3Credential:
        frozen = found.get_frozen_credentials()
        expiry = getattr(found, "_expiry_time", None)
        return {
            "access_key_id": frozen.access_key,
            "secret_access_key": frozen.secret_key,
            "token": frozen.token,
            "expires_at": expiry if isinstance(expiry, datetime) else None,
        }

    return provide, ""


def resolved_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` with the region botocore finds, where they name none: a process given
    them (the listing helper) then needs no botocore import of its own (about 0.2 s)."""
    kwargs, _ = s3_options(options)
    if kwargs is None or "region" in kwargs:
        return dict(options)
    region = _region(kwargs.get("credentials", {})) or (
        "us-east-1" if "endpoint" in kwargs else None
    )
    if region is None:
        return dict(options)
    client = dict(options.get("client_kwargs") or {})
    client["region_name"] = region
    return {**options, "client_kwargs": client}


def _region(creds: Mapping[str, Any]) -> str | None:
    """The region botocore finds: ``$AWS_DEFAULT_REGION`` first (as botocore reads it,
    without importing botocore: about 0.2 s of the first batch), else its config files
    (for ``profile``)."""
    if os.environ.get("AWS_DEFAULT_REGION"):
        return os.environ["AWS_DEFAULT_REGION"]
    import botocore.session

    region = botocore.session.Session(profile=creds.get("profile")).get_config_variable("region")
    return str(region) if region else None


def _summary(exc: BaseException) -> str:
    """obstore's message without its debug dump: the HTTP status and S3 code if any."""
    text = str(exc).split("\n\nDebug source", 1)[0]
    status, code = _STATUS.search(text), _CODE.search(text)
    if status:
        return f"HTTP {status.group(1)}{f' {code.group(1)}' if code else ''}"
    return " ".join(text.split())[:300]


def _translate(exc: BaseException, url: str) -> BaseException:
    """An obstore error as the fsspec path raises it (see the module docstring)."""
    from obstore import exceptions as oe

    if isinstance(exc, FileNotFoundError):
        return FileNotFoundError(f"not found: {url}")
    if isinstance(exc, oe.PreconditionError):
        return VersionChanged(url)
    if isinstance(exc, oe.PermissionDeniedError | oe.UnauthenticatedError):
        return PermissionError(f"{url}: {_summary(exc)}")
    text = str(exc)
    status = _STATUS.search(text)
    if status is not None:
        code = int(status.group(1))
        if code >= 500 or code == 429:
            return ConnectionError(f"{url}: {_summary(exc)}")
        if code in (401, 403):
            return PermissionError(f"{url}: {_summary(exc)}")
        return OSError(f"{url}: {_summary(exc)}")
    head = text.split("\n\nDebug source", 1)[0].lower()
    if isinstance(exc, oe.GenericError) and any(w in head for w in _TRANSIENT_WORDS):
        return ConnectionError(f"{url}: {_summary(exc)}")
    return OSError(f"{url}: {type(exc).__name__}: {_summary(exc)}")


class ObjectStore:
    """The objects of one bucket, read with obstore (one per process, options and
    bucket: see :func:`store_for`)."""

    def __init__(self, bucket: str, kwargs: Mapping[str, Any]) -> None:
        from obstore.store import S3Store

        kw = dict(kwargs)
        creds = kw.pop("credentials", {})
        provider, why = _credentials(creds)
        if why:
            raise ValueError(why)
        if "region" not in kw:
            # botocore's (the environment, the profile); else any, for an endpoint of one
            region = _region(creds) or ("us-east-1" if "endpoint" in kw else None)
            if region is None:
                raise ValueError(
                    "no region: set storage_options={'client_kwargs': {'region_name': ...}} "
                    "(or $AWS_DEFAULT_REGION)"
                )
            kw["region"] = region
        client: ClientConfig = {"timeout": _REQUEST_TIMEOUT}
        client.update(kw.pop("client_options", {}))
        self.bucket = bucket
        self.store: S3Store = S3Store(
            bucket,
            client_options=client,
            retry_config={"max_retries": 0},  # evenly's policy retries, and counts
            credential_provider=provider,
            skip_signature=provider is None,
            **kw,
        )

    @staticmethod
    def _started() -> None:
        """Note that obstore's runtime runs in this process (a fork of it cannot use it)."""
        global _STARTED_IN
        if _STARTED_IN is None:
            _STARTED_IN = os.getpid()

    def key(self, url: str) -> str:
        """The object key of ``s3://bucket/key``."""
        return url.split("://", 1)[-1].split("/", 1)[1]

    def read(self, url: str, start: int, end: int, etag: str | None) -> bytes:
        """Bytes ``[start, end)`` of ``url`` (one request; ``If-Match: etag`` if given)."""
        import obstore

        self._started()

        try:
            result = obstore.get(self.store, self.key(url), options=_options(start, end, etag))
            return bytes(result.bytes())
        except Exception as exc:
            raise _translate(exc, url) from exc

    def read_into(self, url: str, start: int, end: int, etag: str | None, fd: int) -> int:
        """Bytes ``[start, end)`` of ``url`` written to the file ``fd`` at ``start`` as
        they come (one request; ``If-Match: etag`` if given), in chunks of
        :data:`STREAM_CHUNK`: no buffer of the whole range, which the allocator of the
        thread that read it kept afterwards (16 MiB per download thread for 8 MiB
        parts).  Returns the bytes that came (other than ``end - start``: the body was
        cut short, or is longer, and only its first ``end - start`` bytes were written)."""
        import obstore

        self._started()

        came, want = 0, end - start
        try:
            result = obstore.get(self.store, self.key(url), options=_options(start, end, etag))
            chunks = iter(result.stream(min_chunk_size=STREAM_CHUNK))
        except Exception as exc:
            raise _translate(exc, url) from exc
        while True:
            try:
                chunk = next(chunks, None)
            except Exception as exc:
                raise _translate(exc, url) from exc
            if chunk is None:
                return came
            # never past ``end`` (another part's bytes); the local file's errors as they are
            view = memoryview(chunk)[: max(0, want - came)]
            at = start + came
            came += len(chunk)
            while view:
                n = os.pwrite(fd, view, at)
                view, at = view[n:], at + n

    async def read_async(self, url: str, start: int, end: int, etag: str | None) -> bytes:
        """:meth:`read` on the running event loop."""
        import obstore

        self._started()

        try:
            result = await obstore.get_async(
                self.store, self.key(url), options=_options(start, end, etag)
            )
            return bytes(await result.bytes_async())
        except Exception as exc:
            raise _translate(exc, url) from exc

    def download(
        self,
        url: str,
        out: Any,
        etag: str | None,
        check: Callable[[int, str], None],
        received: Callable[[int], None],
    ) -> int:
        """Write the whole object to the binary file ``out`` (one request; ``If-Match:
        etag`` if given); ``check(size, version)`` sees the response's headers before a
        byte is written, ``received(n)`` each chunk.  Returns the bytes written."""
        import obstore

        self._started()

        total = 0
        try:
            result = obstore.get(self.store, self.key(url), options=_options(None, None, etag))
            meta = result.meta
            check(int(meta["size"]), str(meta.get("e_tag") or meta.get("version")))
            for chunk in result.stream(min_chunk_size=STREAM_CHUNK):
                out.write(chunk)
                total += len(chunk)
                received(len(chunk))
        except (VersionChanged, ValueError):
            raise
        except Exception as exc:
            raise _translate(exc, url) from exc
        return total

    def head(self, url: str) -> tuple[int, str]:
        """The object's size and version (ETag) as the storage has it now."""
        import obstore

        self._started()

        try:
            meta = obstore.head(self.store, self.key(url))
        except Exception as exc:
            raise _translate(exc, url) from exc
        return int(meta["size"]), str(meta.get("e_tag") or meta.get("version"))


def listed_etag(fingerprint: str) -> str | None:
    """The ETag in a listed ``size:version`` fingerprint (quoted, as S3 lists it), if any.

    >>> listed_etag('16:"a1"'), listed_etag("16:None"), listed_etag("")
    ('"a1"', None, None)
    """
    version = fingerprint.partition(":")[2]
    return version if version.startswith('"') else None


def _options(start: int | None, end: int | None, etag: str | None) -> Any:
    options: dict[str, Any] = {}
    if start is not None and end is not None:
        options["range"] = (start, end)
    if etag:
        options["if_match"] = etag
    return options


#: bytes per chunk a range read writes to its file (below glibc's default mmap threshold:
#: freed chunks of that size are reused, not kept by each thread's arena)
STREAM_CHUNK = 64 << 10

#: the process where obstore's runtime was started (inherited by a fork: see the module doc)
_STARTED_IN: int | None = None
_STORES: dict[tuple[int, str], ObjectStore | None] = {}
_DECIDED: dict[str, str] = {}  # options -> why fsspec ("" : obstore), kept across forks
_LOCK = threading.Lock()


def _forget_stores() -> None:
    """In a forked child: its own clients (and a lock no parent thread holds)."""
    global _LOCK
    _LOCK = threading.Lock()
    _STORES.clear()


os.register_at_fork(after_in_child=_forget_stores)


def wanted() -> bool | None:
    """``$EVENLY_OBSTORE``: True (``1``), False (``0``) or None (unset: the default)."""
    raw = os.environ.get(ENV, "").strip()
    if raw == "":
        return None
    if raw not in ("0", "1"):
        raise ValueError(
            f"${ENV}={raw!r}: set it to 1 (read s3:// with obstore) or 0 (with fsspec/s3fs), "
            f"or unset it (default: {'obstore' if DEFAULT else 'fsspec'})"
        )
    return raw == "1"


def chosen(url: str, storage_options: Mapping[str, Any]) -> bool:
    """Whether ``url``'s objects are read with obstore: ``s3://``, ``$EVENLY_OBSTORE``
    (unset: :data:`DEFAULT`), obstore installed and the options mapped.  Decided where
    the source is opened (the processes it is pickled to follow that choice); under
    ``$EVENLY_OBSTORE=1`` an error naming what stands in the way, else a fallback to
    fsspec logged once per options."""
    if url.partition("://")[0] not in ("s3", "s3a"):
        return False
    want = wanted()
    if want is False or (want is None and not DEFAULT):
        return False
    store, why = _store(url, storage_options)
    if store is None and want:
        raise ValueError(
            f"${ENV}=1 but s3:// cannot be read with obstore: {why}; unset ${ENV} (or set "
            f"it to 0) to read it with fsspec/s3fs"
        )
    return store is not None


def store_for(
    url: str, storage_options: Mapping[str, Any], use: bool | None = None
) -> ObjectStore | None:
    """This process's obstore client for ``url``'s bucket, or None where fsspec reads
    it.  ``use``: the choice made where the source was opened (:func:`chosen`); None:
    choose here.  A process forked after obstore ran in its parent reads with fsspec
    (logged once: see the module docstring)."""
    if use is None:
        use = chosen(url, storage_options)
    if not use:
        return None
    if _STARTED_IN is not None and os.getpid() != _STARTED_IN:
        if _DECIDED.setdefault(f"forked\n{os.getpid()}", "") == "":
            logger.warning(
                "evenly: s3:// is read with fsspec/s3fs in process %d: it was forked from "
                "process %d after that one read with obstore, whose runtime does not survive "
                "a fork (start workers with multiprocessing_context='spawn' or "
                "'forkserver' to use obstore in them)",
                os.getpid(),
                _STARTED_IN,
            )
            _DECIDED[f"forked\n{os.getpid()}"] = "logged"
        return None
    return _store(url, storage_options)[0]


def _store(url: str, storage_options: Mapping[str, Any]) -> tuple[ObjectStore | None, str]:
    """This process's client for ``url``'s bucket and options (made once), or None and
    why it cannot be made (logged once per options)."""
    bucket = url.split("://", 1)[1].split("/", 1)[0]
    try:
        options = json.dumps(dict(storage_options), sort_keys=True, default=repr)
    except (TypeError, ValueError):
        options = repr(sorted(storage_options))
    key = (os.getpid(), f"{bucket}\n{options}")
    with _LOCK:
        if key in _STORES:
            return _STORES[key], _DECIDED.get(options, "")
    store, why = None, ""
    try:
        import obstore  # noqa: F401
    except ImportError:
        why = "obstore is not installed (pip install 'evenly[s3]')"
    else:
        kwargs, why = s3_options(storage_options)
        if kwargs is not None:
            try:
                store = ObjectStore(bucket, kwargs)
            except ValueError as exc:
                why = str(exc)
    if store is None and why != _DECIDED.get(options):
        logger.warning("evenly: s3:// is read with fsspec/s3fs, not obstore: %s", why)
    _DECIDED[options] = why
    with _LOCK:
        return _STORES.setdefault(key, store), why
