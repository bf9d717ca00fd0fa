"""Shard lists and their cached manifest: per-file row counts plus a content fingerprint.

Opening a source lists its files once (one directory listing, not one request per
file), then reuses every per-file entry whose fingerprint has not changed.  A local
file's fingerprint is its size, ``mtime_ns``, ``ctime_ns`` and inode: ``cp -p``,
``rsync -t``, ``touch`` and reproducible archives can keep size and mtime, but a
rewrite (or a copy) always gets a new ctime, so it is scanned again.  An object's
fingerprint is its size and ETag (else its version id).  Entries are found, in order, in:

1. ``.evenly-manifest.json`` beside the data (written by :func:`evenly.write`);
2. a JSON file in the manifest cache dir, keyed by the file list
   (``$EVENLY_CACHE_DIR/manifests``, default ``~/.cache/evenly/manifests``).

Only new or changed files are scanned (in parallel, by a few threads), so reopening
10,000 shards reads no footer.  A copy of a directory written by ``evenly.write`` is
scanned once (new inodes); an upload of it to S3 is not (ETag = the recorded MD5).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import logging
import os
import posixpath
import tempfile
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import fsspec
import numpy as np
from fsspec.core import url_to_fs

from evenly.sources import _lister, _obstore
from evenly.sources._cachedir import default_cache_dir
from evenly.sources._progress import bar as progress_bar
from evenly.sources._remote_rules import MANIFEST_NAME, is_shard

__all__ = [
    "CONNECT_TIMEOUT",
    "MANIFEST_NAME",
    "READ_TIMEOUT",
    "SCAN_THREADS",
    "FileEntry",
    "Shards",
    "default_cache_dir",
    "filesystem",
    "load_entries",
    "local_fingerprint",
    "object_fingerprint",
    "pack_array",
    "relist",
    "resolve",
    "same_version",
    "save_manifest",
    "unpack_array",
    "with_timeouts",
]

logger = logging.getLogger("evenly")
_VERSION = 2
#: threads that scan new or changed shards at open (remote ones download)
SCAN_THREADS = 8
#: a scan of this many shards or more shows a progress bar (on a terminal)
SCAN_BAR_MIN = 32
#: seconds without a byte from S3 before a read is given up (and retried): a stalled
#: connection fails instead of hanging; ``storage_options={"config_kwargs":
#: {"read_timeout": ...}}`` sets another (botocore's own default is 60 s)
READ_TIMEOUT = 20.0
#: seconds to open a connection to S3 (``config_kwargs={"connect_timeout": ...}``)
CONNECT_TIMEOUT = 10.0


@dataclass(frozen=True)
class FileEntry:
    """What a source needs to know about one shard without opening it."""

    url: str
    fingerprint: str
    num_rows: int
    meta: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "fingerprint": self.fingerprint,
            "num_rows": self.num_rows,
            "meta": self.meta,
        }


@dataclass(frozen=True)
class Shards:
    """Resolved shard URLs (in a stable, sorted order), their filesystem and fingerprints."""

    #: the fsspec filesystem; None where the shards were listed by the helper process
    #: (``s3://`` read with obstore: see ``_lister``)
    fs: Any
    urls: tuple[str, ...]
    fingerprints: tuple[str, ...]
    storage_options: dict[str, Any]
    sizes: tuple[int, ...] = ()
    #: ``.evenly-manifest.json`` beside the data as the helper read it (URL -> text,
    #: None: none there), for :func:`load_entries`; dropped once the entries are loaded
    manifests: dict[str, str | None] | None = field(default=None, compare=False, repr=False)
    #: requests the helper process retried to list them (the source's cache counts them)
    retried: int = field(default=0, compare=False)

    @property
    def remote(self) -> bool:
        return self.fs is None or not _is_local(self.fs)


def _is_local(fs: Any) -> bool:
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return protocol in ("file", "local")


def local_fingerprint(path: str) -> str:
    """``size:mtime_ns:ctime_ns:inode`` of a local file (ctime cannot be set back)."""
    st = os.stat(path)
    return f"{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}:{st.st_ino}"


def object_fingerprint(info: dict[str, Any]) -> str:
    """``size:version`` of an object from its fsspec info (a listing entry or a HEAD):
    the version is its ETag, else its version id, generation or modification time."""
    version = (
        info.get("ETag")
        or info.get("etag")
        or info.get("VersionId")
        or info.get("version_id")
        or info.get("generation")
        or info.get("mtime")
        or info.get("LastModified")
        or info.get("last_modified")
        or info.get("created")
    )
    return f"{info.get('size')}:{version}"


def same_version(then: str, now: str) -> bool:
    """Whether two object fingerprints (``size:version``) can name one version of an
    object: their sizes, and their versions, agree wherever both sides know them.

    >>> same_version('16:"a1"', '16:"a1"'), same_version('16:"a1"', '16:"b2"')
    (True, False)
    >>> same_version('16:"a1"', '17:"a1"'), same_version("16:None", '16:"b2"')
    (False, True)
    """
    if ":" not in then or ":" not in now:  # not of this form: nothing to compare
        return True
    unknown = ("", "None")
    then_size, _, then_version = then.partition(":")
    now_size, _, now_version = now.partition(":")
    if then_size not in unknown and now_size not in unknown and then_size != now_size:
        return False
    return then_version in unknown or now_version in unknown or then_version == now_version


def relist(shards: Shards, retries: int | None = None) -> list[str | None]:
    """Each remote shard's fingerprint as the storage lists it now (None: it is gone).

    One fresh listing per directory holding shards (S3: one request per 1,000 objects),
    not one request per shard; a shard that listing does not show, or shows with no
    version, is asked for by itself (a HEAD).  The filesystem's listing cache is dropped
    first, so nothing listed before is reused.  ``retries``: the helper process's further
    tries of a request after a transient error (None: the policy's default, logged; 0
    where the caller retries the whole listing, as a pass start does with its cache's).
    """
    if shards.fs is None:  # listed by the helper process (obstore): so is this
        try:
            options = _obstore.resolved_options(shards.storage_options)
            return _lister.fingerprints(shards.urls, options, retries)
        except _lister.Fallback as why:
            _log_fallback(str(why))
    fs, _ = filesystem(shards.urls[0], shards.storage_options)  # this process's instance
    paths = [str(fs._strip_protocol(u)) for u in shards.urls]
    by_parent: dict[str, list[int]] = {}
    for k, path in enumerate(paths):
        by_parent.setdefault(posixpath.dirname(path), []).append(k)
    out: list[str | None] = [None] * len(paths)
    for parent, ks in by_parent.items():
        fs.invalidate_cache(parent)
        try:
            listed = {str(i["name"]).rstrip("/"): i for i in fs.ls(parent, detail=True)}
        except (FileNotFoundError, NotADirectoryError):
            listed = {}
        for k in ks:
            info = listed.get(paths[k])
            if info is None or object_fingerprint(info).endswith(":None"):
                try:
                    info = fs.info(paths[k])
                except FileNotFoundError:
                    continue
            out[k] = object_fingerprint(info)
    return out


def _unstrip(fs: Any, path: str) -> str:
    """A full URL for a path as the filesystem returns it."""
    return str(fs.unstrip_protocol(path)) if not _is_local(fs) else str(path)


def resolve(
    paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    extensions: tuple[str, ...],
    storage_options: dict[str, Any] | None = None,
    *,
    what: str,
) -> Shards:
    """Expand ``paths`` (a list, a glob, a directory or an fsspec URL) into shard URLs.

    A directory yields its files (recursively) ending in one of ``extensions``; a glob or
    an explicit list is taken as given.  Raises ``FileNotFoundError`` naming a missing
    path, a glob that matches nothing or a directory without such files.
    """
    items = (
        [os.fspath(paths)]
        if isinstance(paths, str | os.PathLike)
        else [os.fspath(p) for p in paths]
    )
    if not items:
        raise ValueError(f"{what}: no paths given; pass a directory, a glob or a list of files")
    options = with_timeouts(items[0], storage_options)
    helped = _resolve_by_helper(items, extensions, options, what)
    if helped is not None:
        return helped
    fs, _ = filesystem(items[0], options)
    local = _is_local(fs)
    infos: dict[str, dict[str, Any]] = {}
    for item in items:
        item_fs, path = filesystem(item, options)
        if type(item_fs) is not type(fs):
            raise ValueError(
                f"{what}: all paths must be on one filesystem, got {items[0]!r} and {item!r}"
            )
        item_fs.invalidate_cache(path)  # a listing kept from before is not the storage now
        if fsspec.core.has_magic(path):  # type: ignore[attr-defined]
            found = item_fs.glob(path, detail=True)
            if not found:
                raise FileNotFoundError(f"{what}: the glob {item!r} matches no file")
            infos.update({k: v for k, v in found.items() if v.get("type") != "directory"})
            continue
        root = path.rstrip("/")
        found = None
        if not local and not root.endswith(extensions):
            # most likely a directory: listed at once (an object store's info is a HEAD,
            # then a listing, before the listing of its files)
            found = item_fs.find(path, detail=True)
            if not found or set(found) == {root}:  # nothing under it, or a file itself
                found = None
        if found is None:
            try:
                info = item_fs.info(path)
            except FileNotFoundError:
                raise FileNotFoundError(f"{what}: file not found: {item!r}") from None
            if info.get("type") == "directory":
                found = item_fs.find(path, detail=True)
            else:
                infos[info["name"]] = info
                continue
        matched = {
            k: v for k, v in found.items() if is_shard(k, posixpath.relpath(k, root), extensions)
        }
        if not matched:
            raise FileNotFoundError(
                f"{what}: the directory {item!r} holds no file ending in {' or '.join(extensions)}"
            )
        infos.update(matched)
    names = sorted(infos) if len(items) == 1 else list(dict.fromkeys(infos))
    return Shards(
        fs=fs,
        urls=tuple(_unstrip(fs, n) for n in names),
        fingerprints=tuple(
            _stat_fingerprint(n, what) if local else object_fingerprint(infos[n]) for n in names
        ),
        storage_options=options,
        sizes=tuple(int(infos[n].get("size") or 0) for n in names),
    )


def _by_helper(items: Sequence[str], options: Mapping[str, Any]) -> bool:
    """Whether the helper process lists ``items``: ``s3://`` read with obstore, no glob,
    no chained URL."""
    magic = fsspec.core.has_magic  # type: ignore[attr-defined]
    plain = all(
        i.partition("://")[0] in ("s3", "s3a") and "::" not in i and not magic(i) for i in items
    )
    return plain and _obstore.chosen(items[0], options)


def _resolve_by_helper(
    items: Sequence[str], extensions: tuple[str, ...], options: dict[str, Any], what: str
) -> Shards | None:
    """:func:`resolve` by the helper process (see ``_lister``), or None where fsspec must
    list: the main process neither imports s3fs nor starts obstore's runtime."""
    if not _by_helper(items, options):
        return None
    request = {
        "op": "resolve",
        "items": list(items),
        "extensions": list(extensions),
        "options": _obstore.resolved_options(options),
        "what": what,
    }
    retries: list[int] = []
    try:
        got = _lister.run(request, items[0], retried=retries.append, meanwhile=_workers_imports)
    except _lister.Fallback as why:
        _log_fallback(str(why))
        return None
    infos = {str(n): (int(size), str(etag)) for n, size, etag in got["items"]}
    names = sorted(infos) if len(items) == 1 else list(infos)
    return Shards(
        fs=None,
        urls=tuple(f"s3://{n}" for n in names),
        fingerprints=tuple(
            object_fingerprint({"size": infos[n][0], "ETag": infos[n][1]}) for n in names
        ),
        storage_options=options,
        sizes=tuple(infos[n][0] for n in names),
        manifests={str(k): v for k, v in dict(got["manifests"]).items()},
        retried=sum(retries),
    )


def _workers_imports() -> None:
    """Import here, while the listing helper works, numpy's lazily loaded submodules that
    every DataLoader worker forked from this process would otherwise import after its
    fork, before its first request: ``numpy.random`` (torch seeds it in each worker) and
    ``numpy.ma`` (``np.unique`` loads it).  Measured on bench_remote's workload: 40-120 ms
    of each worker's start, depending on the load; here they cost the open nothing (the
    helper takes longer)."""
    import numpy.ma
    import numpy.random  # noqa: F401


def _log_fallback(why: str) -> None:
    logger.warning("evenly: s3:// listed with fsspec/s3fs, not the obstore helper: %s", why)


_FILESYSTEMS: dict[tuple[int, str], Any] = {}
_FILESYSTEMS_LOCK = threading.Lock()
#: ``(session class, data loader)``: botocore's parsed service models of an s3fs
#: session of the process that forked this one, if it had an S3 client
_PARENT_MODELS: list[tuple[Any, Any]] = []


def _forget_filesystems() -> None:
    """In a forked child: a lock a parent's download thread held at the fork would never
    be released, and the parent's instances (their event loop thread) are not there.
    Only the parent's parsed service models are kept (:func:`_parent_models`)."""
    global _FILESYSTEMS_LOCK
    _FILESYSTEMS_LOCK = threading.Lock()
    models = [m for m in map(_models_of, _FILESYSTEMS.values()) if m is not None]
    _PARENT_MODELS[:] = models[:1] or _PARENT_MODELS[:1]
    _FILESYSTEMS.clear()


def _models_of(fs: Any) -> tuple[Any, Any] | None:
    """The class and the data loader (parsed service models) of an s3fs instance's
    botocore session, if it has one."""
    session = getattr(fs, "session", None)
    get = getattr(session, "get_component", None)
    try:
        return None if get is None else (type(session), get("data_loader"))
    except Exception:
        return None


def _parent_models(fs: Any) -> None:
    """Give a new s3fs instance of a forked process a session that reuses the parent's
    parsed service models: a new session parses them again, about 0.5 s of a worker's
    first request on a busy machine (measured).  The models are read-only data; the
    session, its credentials and connections are the instance's own.  Nothing is done
    where the parent had none, or where s3fs does not look as expected."""
    if not _PARENT_MODELS or getattr(fs, "session", "") is not None:
        return
    kind, models = _PARENT_MODELS[0]
    try:
        session = kind(**(getattr(fs, "kwargs", None) or {}))  # as s3fs makes its own
        session.register_component("data_loader", models)
    except Exception:
        return
    fs.session = session


os.register_at_fork(after_in_child=_forget_filesystems)


def filesystem(url: str, storage_options: Mapping[str, Any]) -> tuple[Any, str]:
    """``url_to_fs(url, **storage_options)``, with one filesystem instance per process
    for each protocol and options: a new s3fs instance is a new client (about 0.3 s), and
    with ``skip_instance_cache=True`` fsspec made one for every call (every shard's scan,
    download and listing).  A forked process makes its own (an async filesystem's event
    loop does not survive a fork); chained URLs (``a::b``) are not kept.

    >>> fs, path = filesystem("file:///tmp/x.parquet", {})
    >>> fs is filesystem("file:///tmp/y.parquet", {})[0], path
    (True, '/tmp/x.parquet')
    """
    if "::" in url:
        fs, path = url_to_fs(url, **storage_options)
        return fs, str(path)
    protocol = url.split("://", 1)[0] if "://" in url else "file"
    try:
        options = json.dumps(dict(storage_options), sort_keys=True, default=repr)
    except (TypeError, ValueError):  # options that do not sort: no reuse
        fs, path = url_to_fs(url, **storage_options)
        return fs, str(path)
    key = (os.getpid(), f"{protocol}\n{options}")
    with _FILESYSTEMS_LOCK:
        fs = _FILESYSTEMS.get(key)
    if fs is None:
        fs, path = url_to_fs(url, **storage_options)
        _parent_models(fs)
        with _FILESYSTEMS_LOCK:
            fs = _FILESYSTEMS.setdefault(key, fs)
        return fs, str(path)
    return fs, str(fs._strip_protocol(url))


def with_timeouts(url: str, storage_options: dict[str, Any] | None) -> dict[str, Any]:
    """``storage_options`` with evenly's read and connect timeouts for ``s3://`` URLs
    (s3fs's ``config_kwargs``), where the user set none.

    >>> with_timeouts("s3://bucket/data", {"anon": True})["config_kwargs"]
    {'read_timeout': 20.0, 'connect_timeout': 10.0}
    >>> with_timeouts("s3://b/d", {"config_kwargs": {"read_timeout": 5}})["config_kwargs"]
    {'read_timeout': 5, 'connect_timeout': 10.0}
    >>> with_timeouts("/data", None)
    {}
    """
    options = dict(storage_options or {})
    if url.partition("://")[0] not in ("s3", "s3a"):
        return options
    config = dict(options.get("config_kwargs") or {})
    config.setdefault("read_timeout", READ_TIMEOUT)
    config.setdefault("connect_timeout", CONNECT_TIMEOUT)
    return {**options, "config_kwargs": config}


def _stat_fingerprint(path: str, what: str) -> str:
    try:
        return local_fingerprint(path)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{what}: file not found: {path!r} (removed while the dataset was opened?)"
        ) from None


def _cache_file(kind: str, urls: Sequence[str], cache_dir: str | None) -> str:
    key = hashlib.sha256(("\n".join([kind, *urls])).encode()).hexdigest()[:32]
    return os.path.join(cache_dir or default_cache_dir(), "manifests", f"{kind}-{key}.json")


def _read_json(path: str, fs: Any = None) -> dict[str, Any] | None:
    try:
        if fs is None:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        else:
            with fs.open(path, "rb") as f:
                data = json.loads(f.read().decode("utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("version") != _VERSION:
        return None
    return data


def _parse_json(text: str | None) -> dict[str, Any] | None:
    """:func:`_read_json` of a manifest's text (None: there is none)."""
    try:
        data = None if text is None else json.loads(text)
    except ValueError:
        return None
    if not isinstance(data, dict) or data.get("version") != _VERSION:
        return None
    return data


def _beside(shards: Shards) -> list[str]:
    """Candidate manifests beside the data: one per distinct parent directory."""
    parents = dict.fromkeys(posixpath.dirname(u) for u in shards.urls)
    return [posixpath.join(p, MANIFEST_NAME) for p in parents]


def _known(shards: Shards, kind: str, cache_path: str) -> dict[str, list[dict[str, Any]]]:
    known: dict[str, list[dict[str, Any]]] = {}
    for path in _beside(shards):
        if shards.manifests is not None and path in shards.manifests:
            data = _parse_json(shards.manifests[path])
        else:
            fs, p = filesystem(path, shards.storage_options)
            data = _read_json(p, fs)
        if data is None or data.get("format") != kind:
            continue
        base = posixpath.dirname(path)
        for e in data.get("files", []):
            known.setdefault(posixpath.join(base, e["url"]), []).append(e)
    data = _read_json(cache_path)
    if data is not None:
        for e in data.get("files", []):
            known.setdefault(e["url"], []).append(e)
    return known


def _matches(entry: dict[str, Any], fingerprint: str) -> bool:
    """Same fingerprint; or, for an entry written by ``evenly.write`` (which records the
    MD5), an object store whose ETag is that MD5 (an upload of the same bytes)."""
    if entry.get("fingerprint") == fingerprint:
        return True
    md5 = entry.get("md5")
    return bool(md5) and fingerprint == f'{entry.get("size")}:"{md5}"'


def load_entries(
    shards: Shards,
    kind: str,
    scan: Callable[[int, str], tuple[int, dict[str, Any]]],
    *,
    cache_dir: str | None = None,
    use_cache: bool = True,
) -> list[FileEntry]:
    """One entry per shard: reused from a manifest when its fingerprint matches, else
    ``scan(shard_number, url)`` -> ``(num_rows, meta)``, run by up to ``SCAN_THREADS``
    threads (``scan`` must be thread-safe).  The cache is updated if any shard was
    scanned.  A scan error is raised for the first failing shard in order."""
    cache_path = _cache_file(kind, shards.urls, cache_dir)
    known = _known(shards, kind, cache_path) if use_cache else {}
    found: dict[int, FileEntry] = {}
    missing: list[int] = []
    for k, (url, fp) in enumerate(zip(shards.urls, shards.fingerprints, strict=True)):
        hit = next((e for e in known.get(url, []) if _matches(e, fp)), None)
        if hit is None:
            missing.append(k)
        else:
            found[k] = FileEntry(url, fp, int(hit["num_rows"]), dict(hit.get("meta", {})))
    for k, (num_rows, meta) in zip(missing, _scan_all(scan, shards.urls, missing), strict=True):
        found[k] = FileEntry(shards.urls[k], shards.fingerprints[k], num_rows, meta)
    entries = [found[k] for k in range(len(shards.urls))]
    if missing and use_cache:
        _write_json_atomic(
            cache_path,
            {"version": _VERSION, "format": kind, "files": [e.to_json() for e in entries]},
        )
    return entries


def _scan_all(
    scan: Callable[[int, str], tuple[int, dict[str, Any]]],
    urls: Sequence[str],
    ks: list[int],
) -> list[tuple[int, dict[str, Any]]]:
    """``scan`` each shard in ``ks``, in parallel; results (and the first error) in order.
    A progress bar for :data:`SCAN_BAR_MIN` shards or more (on a terminal only)."""
    show = None if len(ks) >= SCAN_BAR_MIN else False
    with progress_bar(len(ks), "evenly: scanning shards", "shard", show, leave=False) as bar:
        if len(ks) <= 1 or SCAN_THREADS <= 1:
            return [_counted(scan(k, urls[k]), bar) for k in ks]
        with ThreadPoolExecutor(
            max_workers=min(SCAN_THREADS, len(ks)), thread_name_prefix="evenly-scan"
        ) as pool:
            futures = [pool.submit(scan, k, urls[k]) for k in ks]
            try:
                return [_counted(f.result(), bar) for f in futures]
            except BaseException:
                for f in futures:  # do not start the rest; the running ones finish
                    f.cancel()
                raise


def _counted(result: tuple[int, dict[str, Any]], bar: Any) -> tuple[int, dict[str, Any]]:
    bar.update(1)
    return result


def pack_array(a: Any, dtype: str = "<i8") -> str:
    """A numpy array as base64 text, for compact manifests."""
    return base64.b64encode(np.ascontiguousarray(a, dtype=dtype).tobytes()).decode("ascii")


def unpack_array(s: str, dtype: str = "<i8") -> Any:
    """The inverse of :func:`pack_array` (a writable native-endian copy)."""
    return np.frombuffer(base64.b64decode(s), dtype=dtype).astype(dtype.lstrip("<"))


def _md5(path: str) -> str:
    digest = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _write_json_atomic(path: str, data: dict[str, Any]) -> None:
    """Write ``data`` to ``path`` through a temp file and a rename (best effort)."""
    directory = os.path.dirname(path)
    try:
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=".json")
    except OSError:  # a read-only cache must not stop reading the data
        return
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f)
        os.replace(tmp, path)
    except OSError:  # a full disk: the temp file goes, the data is still read
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def save_manifest(out_dir: str, kind: str, entries: Sequence[FileEntry]) -> str:
    """Write ``.evenly-manifest.json`` in ``out_dir`` with URLs relative to it, and each
    file's size and MD5 (so an upload of the directory to S3 reuses it: ETag = MD5)."""
    files = []
    for e in entries:
        data = e.to_json()
        data["url"] = os.path.relpath(e.url, out_dir)
        data["size"] = os.path.getsize(e.url)
        data["md5"] = _md5(e.url)
        files.append(data)
    path = os.path.join(out_dir, MANIFEST_NAME)
    _write_json_atomic(path, {"version": _VERSION, "format": kind, "files": files})
    return path
