"""The listing of ``s3://`` shards read with obstore, done in a short-lived helper process.

The main process lists a remote source where it is opened (and at every later pass
start).  With s3fs that costs its import and a client (about 0.7 s before the first
batch); with obstore in the main process, its runtime would start there and the
DataLoader workers forked from it could not use obstore (see ``_obstore``'s module doc).
So where obstore reads the objects, the listing (and ``.evenly-manifest.json`` beside
the data) is read by ``python _lister.py``, a subprocess run with this file as a script:
it imports neither evenly's package (numpy, pyarrow) nor torch, only ``_obstore.py`` by
its path, and speaks JSON over stdin/stdout.  The subprocess was chosen over a fork of
the main process: a fork of a process with user threads (a training script's) may
inherit a lock held by one of them and hang; a new interpreter costs ~40 ms.

Its answer is ``{"items": [[name, size, etag], ...], "manifests": {url: text | None}}``
(``resolve``), ``{"fingerprints": [...]}`` (``relist``), ``{"fallback": why}`` (a case
the fsspec path must serve: an object without an ETag) or ``{"error": [type, message]}``
(raised again in the main process as that type: ``FileNotFoundError``,
``PermissionError``, ``ConnectionError`` or ``OSError``, the message naming the URL);
each with ``"retried": [[type, message], ...]``, one per retry of a request after a
transient error (the shard cache's policy: ``_remote_rules``), which the main process
logs and counts as the cache counts its own (``fetch_retries``); a request may set
``"retries"`` (0 at a pass start: the shard cache retries the whole listing, counted).
What the package and the helper share (which listed files are shards, the manifest's
name, the retry policy) is in ``_remote_rules.py``, loaded here by its path too.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import posixpath
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

#: seconds the helper may take before it is killed and the open fails naming the URL
#: (each request of it is bounded by the read and connect timeouts, retried a few times)
TIMEOUT = 600.0
logger = logging.getLogger("evenly")
_ERRORS = {
    "FileNotFoundError": FileNotFoundError,
    "PermissionError": PermissionError,
    "ConnectionError": ConnectionError,
    "ValueError": ValueError,
}


def _by_path(name: str) -> ModuleType:
    """The module ``name`` of this folder loaded by its path (not through evenly's
    package: no numpy), as ``_evenly<name>``."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"_evenly{name}", path)
    if spec is None or spec.loader is None:
        raise ImportError(path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


if TYPE_CHECKING or __package__:  # imported as evenly.sources._lister
    from . import _remote_rules as rules
else:  # run as the helper's script
    rules = _by_path("_remote_rules")


class Fallback(Exception):
    """The helper cannot serve this listing as the fsspec path would: use that path."""


def run(
    request: Mapping[str, Any],
    url: str,
    timeout: float | None = None,
    retried: Callable[[int], None] | None = None,
    meanwhile: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Run the helper on ``request``; its answer, or its error raised here naming ``url``.
    Each retry it made is logged, and their number given to ``retried`` (the cache's
    ``fetch_retries``), before its answer is returned or its error raised.
    ``meanwhile()`` runs in this process while the helper lists (its request already
    sent): work of the open that does not need the listing, off the critical path."""
    try:
        data = json.dumps(dict(request))
    except (TypeError, ValueError) as exc:  # options that JSON cannot carry
        raise Fallback(f"storage_options not JSON: {exc}") from None
    if not sys.executable or getattr(sys, "frozen", False):  # no interpreter to run it
        raise Fallback("no Python executable to run the listing helper with")
    limit = TIMEOUT if timeout is None else timeout
    try:
        proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
    except OSError as exc:  # it could not be started
        raise Fallback(f"the listing helper process could not start: {exc}") from None
    try:
        stdin, proc.stdin = proc.stdin, None  # sent now: communicate() only reads
        if stdin is not None:
            try:  # it reads the whole request before it sends one of its own
                stdin.write(data.encode())
                stdin.close()
            except BrokenPipeError:  # it died: its exit status and stderr say why
                with contextlib.suppress(OSError):
                    stdin.close()
        if meanwhile is not None:
            meanwhile()
        stdout, stderr = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise TimeoutError(
            f"listing {url}: it took more than {limit:.0f} s (the listing helper process "
            f"was stopped); check the endpoint and the network"
        ) from None
    except BaseException:
        proc.kill()
        proc.communicate()
        raise
    try:
        answer = json.loads(stdout.decode() or "null")
    except ValueError:
        answer = None
    if not isinstance(answer, dict):  # it crashed (not an error of the storage's)
        tail = stderr.decode(errors="replace").strip().splitlines()[-3:]
        raise Fallback(
            f"the listing helper process failed (exit {proc.returncode}): "
            f"{' / '.join(tail) or 'no output'}"
        )
    _retried(answer.get("retried") or [], retried)
    if "error" in answer:
        kind, message = answer["error"]
        raise _ERRORS.get(kind, OSError)(message)
    if "fallback" in answer:
        raise Fallback(str(answer["fallback"]))
    return answer


def _retried(retries: Sequence[Sequence[str]], retried: Callable[[int], None] | None) -> None:
    """Log the helper's retries (its own log is not seen) and count them."""
    for kind, message in retries:
        logger.warning("evenly: the s3:// listing retried a request: %s: %s", kind, message)
    if retries and retried is not None:
        retried(len(retries))


# ---- the helper process ----------------------------------------------------------


class _Lister:
    def __init__(self, request: Mapping[str, Any]) -> None:
        import obstore

        self.ob = obstore
        self.mod: Any = _by_path("_obstore")
        self.options: dict[str, Any] = dict(request["options"])
        self.stores: dict[str, Any] = {}
        #: further tries of a request after a transient error (0: the caller retries)
        self.retries = int(request.get("retries", rules.RETRIES))
        #: ``[type, message]`` of each retry after a transient error, for the answer
        self.retried: list[list[str]] = []

    def store(self, bucket: str) -> Any:
        if bucket not in self.stores:
            kwargs, why = self.mod.s3_options(self.options)
            if kwargs is None:
                raise Fallback(why)
            self.stores[bucket] = self.mod.ObjectStore(bucket, kwargs).store
        return self.stores[bucket]

    def call(self, url: str, fn: Any) -> Any:
        """``fn()``, retried after a transient error as the shard cache retries (each
        retry noted for the answer); errors as the fsspec path's, naming ``url``."""

        def once() -> Any:
            try:
                return fn()
            except Exception as exc:
                raise self.mod._translate(exc, url) from exc

        def note(tries: int, delay: float, exc: Exception) -> None:
            self.retried.append([type(exc).__name__, str(exc)])

        return rules.retrying(once, retries=self.retries, on_retry=note)

    def find(self, bucket: str, prefix: str) -> list[dict[str, Any]]:
        """Every object under ``prefix/`` (recursively)."""
        store = self.store(bucket)
        url = f"s3://{bucket}/{prefix}"
        chunks = self.call(url, lambda: list(self.ob.list(store, prefix=prefix, chunk_size=1000)))
        return [m for chunk in chunks for m in chunk if not str(m["path"]).endswith("/")]

    def ls(self, bucket: str, prefix: str) -> list[dict[str, Any]]:
        """The objects directly in ``prefix/``."""
        store = self.store(bucket)
        url = f"s3://{bucket}/{prefix}"
        found = self.call(url, lambda: self.ob.list_with_delimiter(store, prefix=prefix))
        return list(found["objects"])

    def head(self, bucket: str, key: str) -> dict[str, Any] | None:
        store = self.store(bucket)
        try:
            return dict(self.call(f"s3://{bucket}/{key}", lambda: self.ob.head(store, key)))
        except FileNotFoundError:
            return None

    def text(self, bucket: str, key: str) -> str | None:
        """An object's text, None if it is missing or cannot be read (as ``_read_json``)."""
        store = self.store(bucket)
        try:
            got = self.call(f"s3://{bucket}/{key}", lambda: self.ob.get(store, key).bytes())
            return bytes(got).decode("utf-8")
        except (OSError, ValueError):
            return None


def _etag(meta: Mapping[str, Any]) -> str:
    version = meta.get("e_tag") or meta.get("version")
    if not version:
        raise Fallback(f"{meta.get('path')}: listed without an ETag or a version")
    return str(version)


def _split(url: str) -> tuple[str, str]:
    bucket, _, key = url.split("://", 1)[1].partition("/")
    return bucket, key


def _resolve(lister: _Lister, request: Mapping[str, Any]) -> dict[str, Any]:
    """As ``_manifest.resolve`` for non-glob ``s3://`` items (see there)."""
    what, extensions = str(request["what"]), tuple(request["extensions"])
    infos: dict[str, tuple[int, str]] = {}
    listed: dict[str, set[str]] = {}  # directory -> the names listed in it
    for item in request["items"]:
        bucket, key = _split(item)
        root = key.rstrip("/")
        found: list[dict[str, Any]] | None = None
        if not root.endswith(extensions):
            found = lister.find(bucket, root) or None
        if found is None:
            meta = lister.head(bucket, root) if root else None
            if meta is not None:
                infos[f"{bucket}/{root}"] = (int(meta["size"]), _etag(meta))
                continue
            found = lister.find(bucket, root) if root.endswith(extensions) else []
            if not found:
                raise FileNotFoundError(f"{what}: file not found: {item!r}")
        for m in found:
            parent = posixpath.dirname(f"{bucket}/{m['path']}")
            listed.setdefault(parent, set()).add(posixpath.basename(str(m["path"])))
        matched = {
            f"{bucket}/{m['path']}": (int(m["size"]), _etag(m))
            for m in found
            if rules.is_shard(
                str(m["path"]),
                posixpath.relpath(str(m["path"]), root) if root else str(m["path"]),
                extensions,
            )
        }
        if not matched:
            raise FileNotFoundError(
                f"{what}: the directory {item!r} holds no file ending in {' or '.join(extensions)}"
            )
        infos.update(matched)
    manifests: dict[str, str | None] = {}
    for parent in dict.fromkeys(posixpath.dirname(n) for n in infos):
        seen = listed.get(parent)
        bucket, _, key = parent.partition("/")
        text = None
        if seen is None or rules.MANIFEST_NAME in seen:  # a listed directory without one: none
            text = lister.text(bucket, posixpath.join(key, rules.MANIFEST_NAME))
        manifests[posixpath.join(f"s3://{parent}", rules.MANIFEST_NAME)] = text
    return {"items": [[n, s, e] for n, (s, e) in infos.items()], "manifests": manifests}


def _relist(lister: _Lister, request: Mapping[str, Any]) -> dict[str, Any]:
    """As ``_manifest.relist`` (see there)."""
    names = [_split(u) for u in request["urls"]]
    by_parent: dict[tuple[str, str], list[int]] = {}
    for k, (bucket, key) in enumerate(names):
        by_parent.setdefault((bucket, posixpath.dirname(key)), []).append(k)
    out: list[str | None] = [None] * len(names)
    for (bucket, parent), ks in by_parent.items():
        try:
            listed = {str(m["path"]): m for m in lister.ls(bucket, parent)}
        except FileNotFoundError:
            listed = {}
        for k in ks:
            meta = listed.get(names[k][1])
            if meta is None or not (meta.get("e_tag") or meta.get("version")):
                meta = lister.head(bucket, names[k][1])
            if meta is not None:
                out[k] = f"{int(meta['size'])}:{_etag(meta)}"
    return {"fingerprints": out}


def main() -> None:
    request = json.loads(sys.stdin.read())
    lister: _Lister | None = None
    answer: dict[str, Any]
    try:
        lister = _Lister(request)
        answer = (_resolve if request["op"] == "resolve" else _relist)(lister, request)
    except Fallback as exc:
        answer = {"fallback": str(exc)}
    except (OSError, ValueError) as exc:
        kind = next((n for n, t in _ERRORS.items() if type(exc) is t), "OSError")
        answer = {"error": [kind, str(exc)]}
    answer["retried"] = [] if lister is None else lister.retried
    sys.stdout.write(json.dumps(answer))


def fingerprints(
    urls: Sequence[str], options: Mapping[str, Any], retries: int | None = None
) -> list[str | None]:
    """``_manifest.relist`` by the helper: each URL's ``size:etag`` now (None: gone);
    ``retries``: see ``_manifest.relist``."""
    request: dict[str, Any] = {"op": "relist", "urls": list(urls), "options": dict(options)}
    if retries is not None:
        request["retries"] = int(retries)
    got = run(request, urls[0])
    return [None if f is None else str(f) for f in got["fingerprints"]]


if __name__ == "__main__":
    sys.path.pop(0)  # this file's folder: its modules are not top-level ones
    main()
