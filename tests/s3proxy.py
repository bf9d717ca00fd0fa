"""An HTTP/1.1 proxy on 127.0.0.1 in front of an S3-compatible server (moto's), for the
remote tests and ``bench/bench_remote.py``: a per-request delay, bandwidth caps (a token
bucket for all connections together, one per connection), counters, and injected faults.

>>> with S3Proxy("http://127.0.0.1:1", delay=0.02, bandwidth=100e6) as proxy:
...     proxy.url.startswith("http://127.0.0.1:"), proxy.stats()["requests"]
(True, 0)

Point a client at ``proxy.url`` instead of the server (``client_kwargs={"endpoint_url":
proxy.url}`` for s3fs).  The proxy runs an asyncio loop in a daemon thread; ``close()``
(or leaving the ``with`` block, or the interpreter exiting) stops it.  Each client
connection gets its own upstream connection, reused across requests (keep-alive).

- ``delay``: seconds added before each request is forwarded (a round trip).
- ``bandwidth``: bytes/s of response bodies, all connections together;
  ``per_connection_bandwidth``: bytes/s per client connection.  Request bodies are not
  throttled (uploads are the tests' set-up).
- ``stats()``: ``requests``, ``listings``, ``bytes`` (response body bytes sent), ``gets_by_key``
  (``{"bucket/key": GETs of that object received}``, faulted ones included, listings
  excluded), ``max_concurrent``
  (requests in flight at once), ``served_at_end`` (``[("bucket/key", bytes)]``: each
  GET of an object in the order its response ended, with the body bytes sent by all
  connections until then), ``agents`` (``{"bucket/key": {client: GETs}}``, the
  client being the product in the User-Agent: ``botocore`` for s3fs, ``object_store``
  for obstore); ``reset_stats()`` zeroes them.
- ``fault(kind, match=None, times=1, after=0, methods=("GET",), **kw)``: the next
  ``times`` requests (``None``: every one from then on) whose method is in ``methods``
  and whose ``bucket/key?query`` contains ``match``, after ``after`` such requests went
  through untouched, get the fault ``kind``:

  ``"reset"``     headers and ``at`` body bytes (default: half), then a TCP reset
  ``"short"``     headers (the full Content-Length) and ``at`` bytes, then a clean close
  ``"stall"``     headers and ``at`` bytes, then nothing for ``seconds`` (default 60),
                  then a close
  ``"status"``    an S3 XML error, ``status`` (default 503) and ``code`` (default by
                  status: SlowDown, TooManyRequests, InternalError), upstream untouched
  ``"forbidden"`` a 403 ``code`` (default ExpiredToken), by default for every matching
                  request from then on (``times=None``): expired credentials
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import socket
import struct
import threading
import time
import urllib.parse
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["S3Proxy"]

_CHUNK = 64 << 10
_KINDS = frozenset({"reset", "short", "stall", "status", "forbidden"})
_DEFAULT_CODES = {
    503: ("SlowDown", "Please reduce your request rate."),
    429: ("TooManyRequests", "Too many requests."),
    500: ("InternalError", "We encountered an internal error. Please try again."),
    403: ("ExpiredToken", "The provided token has expired."),
}


class _Unset:
    pass


_UNSET = _Unset()


class _Bucket:
    """A token bucket in virtual time: each take reserves its slot, so concurrent takers
    (coroutines of one loop) share the rate fairly; a burst of ``burst_s`` is allowed."""

    def __init__(self, rate: float, burst_s: float = 0.02) -> None:
        self.rate = float(rate)
        self.burst = burst_s
        self.t = 0.0

    async def take(self, n: int) -> None:
        now = time.monotonic()
        self.t = max(self.t, now - self.burst) + n / self.rate
        if self.t > now:
            await asyncio.sleep(self.t - now)


@dataclass
class _Fault:
    kind: str
    match: str | None
    times: int | None
    after: int
    methods: frozenset[str]
    kw: dict[str, Any] = field(default_factory=dict)

    def applies(self, method: str, target: str) -> bool:
        return method in self.methods and (self.match is None or self.match in target)


def _client_name(agent: str) -> str:
    """``botocore`` or ``object_store`` (say) from a User-Agent header: the product of its
    first word (aiobotocore puts ``botocore/x.y`` after its own name: taken when there)."""
    words = agent.split()
    named = [w for w in words if w.lower().startswith("botocore/")]
    return (named or words or ["?"])[0].split("/", 1)[0]


class _Request:
    def __init__(self, head: bytes, body: bytes) -> None:
        lines = head.decode("latin-1").split("\r\n")
        self.method, self.target, _ = lines[0].split(" ", 2)
        self.headers = [tuple(x.split(":", 1)) for x in lines[1:] if x]
        self.body = body
        path = urllib.parse.urlsplit(self.target)
        self.key = urllib.parse.unquote(path.path.lstrip("/"))
        self.query = path.query

    def header(self, name: str) -> str | None:
        for k, v in self.headers:
            if k.strip().lower() == name:
                return v.strip()
        return None

    def raw(self) -> bytes:
        """The request as forwarded: ``Expect`` dropped (the proxy answered it)."""
        lines = [f"{self.method} {self.target} HTTP/1.1"]
        lines += [f"{k}:{v}" for k, v in self.headers if k.strip().lower() != "expect"]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + self.body


class S3Proxy:
    """A throttling, fault-injecting HTTP/1.1 proxy to ``upstream_url`` (see the module
    docstring), bound to 127.0.0.1 on a free port."""

    def __init__(
        self,
        upstream_url: str,
        *,
        delay: float = 0.0,
        bandwidth: float | None = None,
        per_connection_bandwidth: float | None = None,
    ) -> None:
        up = urllib.parse.urlsplit(upstream_url)
        if up.scheme != "http" or up.hostname is None:
            raise ValueError(f"S3Proxy needs an http:// upstream, got {upstream_url!r}")
        self.upstream = (up.hostname, up.port or 80)
        self.delay = float(delay)
        self.per_connection_bandwidth = per_connection_bandwidth
        self._total = _Bucket(bandwidth) if bandwidth else None
        self._faults: list[_Fault] = []
        self._lock = threading.Lock()
        self.reset_stats()
        self._loop = asyncio.new_event_loop()
        self._tasks: set[asyncio.Task[Any]] = set()
        #: every connection's writer not closed yet (clients' and upstream ones): all
        #: closed at shutdown, whatever was cut short
        self._writers: set[asyncio.StreamWriter] = set()
        self._server: asyncio.Server | None = None
        self._closed = False
        ready = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(ready,), name="s3proxy", daemon=True
        )
        self._thread.start()
        ready.wait()
        assert self._server is not None
        self.port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        atexit.register(self.close)

    # ---- control (any thread) ----------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """``requests``, ``listings`` (GETs on the bucket), ``bytes``, ``gets_by_key`` and
        ``max_concurrent`` so far."""
        with self._lock:
            return {
                "requests": self._requests,
                "listings": self._listings,
                "bytes": self._bytes,
                "gets_by_key": dict(self._gets),
                "max_concurrent": self._max_concurrent,
                "served_at_end": list(self._ends),
                "agents": {k: dict(v) for k, v in self._agents.items()},
            }

    def reset_stats(self) -> None:
        with self._lock:
            self._requests = self._bytes = self._max_concurrent = self._in_flight = 0
            self._listings = 0
            self._gets: dict[str, int] = {}
            self._ends: list[tuple[str, int]] = []
            self._agents: dict[str, dict[str, int]] = {}

    def fault(
        self,
        kind: str,
        *,
        match: str | None = None,
        times: int | _Unset | None = _UNSET,
        after: int = 0,
        methods: Iterable[str] = ("GET",),
        **kw: Any,
    ) -> None:
        """Inject ``kind`` into the next matching request(s) (see the module docstring);
        ``forbidden`` defaults to every matching request from then on."""
        if kind not in _KINDS:
            raise ValueError(f"unknown fault {kind!r}: one of {sorted(_KINDS)}")
        if isinstance(times, _Unset):
            times = None if kind == "forbidden" else 1
        with self._lock:
            self._faults.append(
                _Fault(kind, match, times, after, frozenset(m.upper() for m in methods), kw)
            )

    def clear_faults(self) -> None:
        with self._lock:
            self._faults.clear()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(RuntimeError):
            asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(60)
        self._thread.join(60)
        with contextlib.suppress(Exception):
            atexit.unregister(self.close)

    def __enter__(self) -> S3Proxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- the loop's thread ---------------------------------------------------------
    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)

        async def start() -> None:
            self._server = await asyncio.start_server(self._client, "127.0.0.1", 0)

        self._loop.run_until_complete(start())
        ready.set()
        self._loop.run_forever()
        # connections accepted while the proxy shut down: ended here, before the loop
        # closes (a task destroyed pending would warn, and its cleanup raise, at GC)
        self._loop.run_until_complete(self._end_connections())
        self._loop.run_until_complete(self._loop.shutdown_asyncgens())
        self._loop.close()

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        await self._end_connections()
        self._loop.call_soon(self._loop.stop)

    async def _end_connections(self) -> None:
        """End every connection's task, also one accepted after the first round.  Each
        task first runs (one turn of the loop) so that its ``finally`` closes its socket
        when cancelled: a task cancelled before its first step never runs its body, and
        its socket would be left open."""
        me = asyncio.current_task()
        while True:
            await asyncio.sleep(0)
            tasks = [t for t in asyncio.all_tasks() if t is not me and not t.done()]
            if not tasks:
                break
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        for writer in list(self._writers):  # what a cut-short exchange left open
            writer.close()
        self._writers.clear()
        for _ in range(3):  # a closed transport's socket is closed on a later turn
            await asyncio.sleep(0)

    def _take_fault(self, req: _Request) -> _Fault | None:
        with self._lock:
            for f in self._faults:
                if not f.applies(req.method, f"{req.key}?{req.query}"):
                    continue
                if f.after > 0:
                    f.after -= 1
                    return None
                if f.times is not None:
                    f.times -= 1
                    if f.times <= 0:
                        self._faults.remove(f)
                return f
        return None

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self._writers.add(writer)
        conn = _Bucket(self.per_connection_bandwidth) if self.per_connection_bandwidth else None
        upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        try:
            while True:
                req = await _read_request(reader, writer)
                if req is None:
                    return
                with self._lock:
                    self._requests += 1
                    if req.method == "GET" and "/" not in req.key.strip("/"):
                        self._listings += 1  # a GET on the bucket: ListObjects
                    if req.method == "GET" and "/" in req.key.strip("/"):
                        self._gets[req.key] = self._gets.get(req.key, 0) + 1
                        agent = _client_name(req.header("user-agent") or "")
                        seen = self._agents.setdefault(req.key, {})
                        seen[agent] = seen.get(agent, 0) + 1
                    self._in_flight += 1
                    self._max_concurrent = max(self._max_concurrent, self._in_flight)
                try:
                    if self.delay:
                        await asyncio.sleep(self.delay)
                    fault = self._take_fault(req)
                    if fault is not None and fault.kind in ("status", "forbidden"):
                        await _send_error(writer, req, fault)
                        continue
                    upstream, head = await self._exchange(req, upstream)
                    keep = await self._forward(req, head, upstream, writer, conn, fault)
                finally:
                    with self._lock:
                        self._in_flight -= 1
                        if req.method == "GET" and "/" in req.key.strip("/"):
                            self._ends.append((req.key, self._bytes))
                if fault is not None or not keep:
                    return
                if (req.header("connection") or "").lower() == "close":
                    return
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            return
        except asyncio.CancelledError:
            return
        finally:
            if upstream is not None:
                upstream[1].close()
                self._writers.discard(upstream[1])
            if not writer.is_closing():
                writer.close()
            self._writers.discard(writer)
            self._tasks.discard(task)

    async def _exchange(
        self, req: _Request, upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None
    ) -> tuple[tuple[asyncio.StreamReader, asyncio.StreamWriter], bytes]:
        """Send ``req`` upstream and read the response head, on a fresh connection if
        the kept-alive one was closed by the server meanwhile."""
        for fresh in (upstream is None, True):
            if fresh:
                if upstream is not None:
                    upstream[1].close()
                    self._writers.discard(upstream[1])
                upstream = await asyncio.open_connection(*self.upstream)
                self._writers.add(upstream[1])
            assert upstream is not None
            try:
                upstream[1].write(req.raw())
                await upstream[1].drain()
                return upstream, await upstream[0].readuntil(b"\r\n\r\n")
            except (ConnectionError, asyncio.IncompleteReadError):
                if fresh:
                    raise  # the writer is closed at shutdown (self._writers)
        raise AssertionError("unreachable")

    async def _forward(
        self,
        req: _Request,
        head: bytes,
        upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        writer: asyncio.StreamWriter,
        conn: _Bucket | None,
        fault: _Fault | None,
    ) -> bool:
        """Send ``req`` upstream and its response back; whether both connections stay
        open (``False`` after a fault, or a response delimited by the close)."""
        up_r = upstream[0]
        status = int(head.split(b" ", 2)[1])
        headers = _headers(head)
        no_body = req.method == "HEAD" or status in (204, 304) or 100 <= status < 200
        length = None if no_body else headers.get("content-length")
        chunked = not no_body and "chunked" in headers.get("transfer-encoding", "").lower()
        writer.write(head)
        if fault is not None:  # reset, short or stall: part of a body, then no more
            total = int(length) if length is not None else _CHUNK
            at = int(fault.kw.get("at", total // 2))
            sent = 0
            while sent < at:
                data = await up_r.read(min(_CHUNK, at - sent))
                if not data:
                    break
                await self._send(writer, data, conn)
                sent += len(data)
            await writer.drain()
            if fault.kind == "stall":
                await asyncio.sleep(float(fault.kw.get("seconds", 60.0)))
            if fault.kind == "reset":
                sock = writer.get_extra_info("socket")
                if sock is not None:  # linger 0: the close sends RST
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                writer.transport.abort()
            else:
                writer.close()
            return False
        if no_body:
            await writer.drain()
        elif length is not None:
            left = int(length)
            while left > 0:
                data = await up_r.read(min(_CHUNK, left))
                if not data:
                    raise ConnectionError("upstream closed mid-body")
                await self._send(writer, data, conn)
                left -= len(data)
        elif chunked:
            while True:
                line = await up_r.readuntil(b"\r\n")
                size = int(line.split(b";")[0], 16)
                writer.write(line)
                if size == 0:
                    while (trailer := await up_r.readuntil(b"\r\n")) != b"\r\n":
                        writer.write(trailer)
                    writer.write(b"\r\n")
                    break
                data = await up_r.readexactly(size + 2)
                await self._send(writer, data, conn)
        else:  # delimited by the close
            while data := await up_r.read(_CHUNK):
                await self._send(writer, data, conn)
            await writer.drain()
            return False
        await writer.drain()
        return headers.get("connection", "").lower() != "close"

    async def _send(self, writer: asyncio.StreamWriter, data: bytes, conn: _Bucket | None) -> None:
        if self._total is not None:
            await self._total.take(len(data))
        if conn is not None:
            await conn.take(len(data))
        writer.write(data)
        await writer.drain()
        with self._lock:
            self._bytes += len(data)


def _headers(head: bytes) -> dict[str, str]:
    out = {}
    for line in head.decode("latin-1").split("\r\n")[1:]:
        if ":" in line:
            k, v = line.split(":", 1)
            out[k.strip().lower()] = v.strip()
    return out


async def _read_request(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> _Request | None:
    """The next request on a client connection (None when the client closed it); an
    ``Expect: 100-continue`` is answered here, so the body follows at once."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None
    headers = _headers(head)
    if headers.get("expect", "").lower() == "100-continue":
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        await writer.drain()
    if "chunked" in headers.get("transfer-encoding", "").lower():
        parts = []
        while True:
            line = await reader.readuntil(b"\r\n")
            parts.append(line)
            size = int(line.split(b";")[0], 16)
            if size == 0:
                while (trailer := await reader.readuntil(b"\r\n")) != b"\r\n":
                    parts.append(trailer)
                parts.append(b"\r\n")
                break
            parts.append(await reader.readexactly(size + 2))
        body = b"".join(parts)
    else:
        body = await reader.readexactly(int(headers.get("content-length", "0")))
    return _Request(head, body)


async def _send_error(writer: asyncio.StreamWriter, req: _Request, fault: _Fault) -> None:
    status = int(fault.kw.get("status", 403 if fault.kind == "forbidden" else 503))
    code, message = _DEFAULT_CODES.get(status, ("InternalError", "Error."))
    code = str(fault.kw.get("code", code))
    message = str(fault.kw.get("message", message))
    body = (
        f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
        f"<Message>{message}</Message><Resource>/{req.key}</Resource>"
        f"<RequestId>s3proxy</RequestId></Error>"
    ).encode()
    reason = {403: "Forbidden", 429: "Too Many Requests", 500: "Internal Server Error"}.get(
        status, "Service Unavailable"
    )
    head = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/xml\r\n"
        f"Content-Length: {len(body)}\r\nx-amz-request-id: s3proxy\r\n\r\n"
    ).encode()
    writer.write(head if req.method == "HEAD" else head + body)
    await writer.drain()
