"""How the gateway talks HTTP to rollout pods: a two-method interface and a lean HTTP/1.1 client.

The pod protocol is one JSON POST (and a ``/readyz`` GET) per request over keep-alive connections, so the
client here is only that: a pool of keep-alive connections per pod, each an ``asyncio.Protocol`` whose
responses are parsed by ``httptools`` (llhttp, the parser uvicorn serves with: Content-Length, chunked
and close-delimited bodies). Measured on the CPU box against a trivial pod at 64 in flight, one POST
costs ~17 us of CPU here, ~80 us with aiohttp and 600-1200 us with httpx; at 64 concurrent turns that
difference is queueing on the gateway's event loop (BENCHMARKS.md "Gateway overhead").
``services.gateway.testing.FakePods`` implements the same interface in memory for unit tests.
"""

from __future__ import annotations

import abc
import asyncio
import json
import ssl
import time
from typing import Any, Callable
from urllib.parse import urlsplit

import httptools
import msgspec


def json_loads(raw: bytes) -> Any:
    """``json.loads``, 3-5x faster: msgspec parses what it can, and the standard library takes whatever msgspec
    refuses (NaN, integers past 64 bits, malformed input), so what is accepted and the errors stay json's."""
    try:
        return msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return json.loads(raw)


def generate_body(prompt_ids: list[int], sampling_params: dict) -> bytes:
    """The /v1/generate request. The token ids (thousands on a long episode) are encoded by msgspec, 13x
    faster than json.dumps; the sampling params by json.dumps, exactly as before (NaN included)."""
    try:
        ids = msgspec.json.encode(prompt_ids)
    except (OverflowError, msgspec.EncodeError, TypeError):
        ids = json.dumps(prompt_ids).encode()
    return b'{"prompt_token_ids":' + ids + b',"sampling_params":' + json.dumps(sampling_params).encode() + b"}"


class PodConnectionError(Exception):
    """The pod could not be reached or did not answer in time (connection refused/reset, timeout)."""


class PodTransport(abc.ABC):
    @abc.abstractmethod
    async def post_json(self, url: str, body: bytes) -> tuple[int, bytes, float]:
        """POST a JSON body; (status, response body, ``time.perf_counter()`` when the answer had fully arrived,
        so time spent queued on the event loop afterwards counts as the gateway's, not the pod's).
        Raises PodConnectionError on transport failure."""

    def channel(self, url: str) -> Any:
        """A ``PodChannel`` (one full-duplex generate stream) to the pod at ``url``, or None where this
        transport has none: the pool then sends one request per call."""
        return None

    @abc.abstractmethod
    async def get(self, url: str, timeout_s: float) -> int:
        """GET; the status. Raises PodConnectionError on transport failure."""

    async def close(self) -> None:
        return None


class _Connection(asyncio.Protocol):
    """One keep-alive connection; at most one request in flight on it."""

    def __init__(self, origin: _Origin) -> None:
        self.origin = origin
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.waiter: asyncio.Future | None = None
        self.chunks: list[bytes] = []
        # Streaming mode (HttpTransport.relay): the status and headers, then each body piece, go to ``sink``
        # as they arrive instead of being collected.
        self.sink: Callable[[int, list[tuple[bytes, bytes]] | None, bytes], None] | None = None
        self.headers: list[tuple[bytes, bytes]] = []
        self.received = False  # any byte of the current response
        self.headers_done = False
        self.delimited = False  # Content-Length or chunked: the body does not end at EOF
        self.keep_alive = False
        self.closed = False
        self.idle_since = 0.0

    # ---- asyncio.Protocol / httptools callbacks

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.received = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._finish(exc=PodConnectionError(f"malformed HTTP response: {exc}"))
            self.close()

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"content-length" or (name == b"transfer-encoding" and b"chunked" in value.lower()):
            self.delimited = True
        if self.sink is not None:
            self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.headers_done = True
        if self.sink is not None:
            self.sink(self.parser.get_status_code(), self.headers, b"")

    def on_body(self, body: bytes) -> None:
        if self.sink is not None:
            self.sink(0, None, body)
        else:
            self.chunks.append(body)

    def on_message_complete(self) -> None:
        self.keep_alive = self.parser.should_keep_alive()
        self._finish(result=(self.parser.get_status_code(), b"".join(self.chunks), time.perf_counter()))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.origin.forget(self)
        if self.waiter is not None and self.headers_done and not self.delimited and exc is None:
            # The body ended at EOF.
            self._finish(result=(self.parser.get_status_code(), b"".join(self.chunks), time.perf_counter()))
        else:
            self._finish(exc=ConnectionResetError("the pod closed the connection") if exc is None else exc)

    # ----

    def _finish(self, result: tuple[int, bytes, float] | None = None, exc: BaseException | None = None) -> None:
        waiter, self.waiter = self.waiter, None
        self.chunks = []
        if waiter is None or waiter.done():
            return
        if exc is not None:
            waiter.set_exception(exc)
        else:
            waiter.set_result(result)

    def timed_out(self) -> None:
        self._finish(exc=asyncio.TimeoutError())
        self.close()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class _Origin:
    """Keep-alive connections to one scheme://host:port, most recently used last."""

    def __init__(self, scheme: str, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.ssl = ssl.create_default_context() if scheme == "https" else None
        self.host_header = f"Host: {f'[{host}]' if ':' in host else host}:{port}\r\n".encode()
        self.idle: list[_Connection] = []

    def forget(self, conn: _Connection) -> None:
        if conn in self.idle:
            self.idle.remove(conn)


class HttpTransport(PodTransport):
    IDLE_S = 4.0
    """Idle connections older than this are closed instead of reused: uvicorn (the pods' server) drops
    keep-alive connections after 5 s, and a request written into one the server is closing is lost."""

    def __init__(self, max_connections: int, timeout_s: float, connect_timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.max_connections = max_connections
        self._origins: dict[str, _Origin] = {}
        self._targets: dict[str, tuple[_Origin, bytes]] = {}
        self._slots: asyncio.Semaphore | None = None

    def _target(self, url: str) -> tuple[_Origin, bytes]:
        """(origin, request-line path) of a URL, parsed once."""
        hit = self._targets.get(url)
        if hit is None:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise PodConnectionError(f"unsupported pod URL {url!r}: expected http(s)://HOST:PORT/...")
            port = parts.port or (443 if parts.scheme == "https" else 80)
            key = f"{parts.scheme}://{parts.hostname}:{port}"
            origin = self._origins.get(key) or self._origins.setdefault(key, _Origin(parts.scheme, parts.hostname,
                                                                                     port))
            path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            hit = self._targets[url] = (origin, path.encode())
        return hit

    def _pooled(self, origin: _Origin) -> _Connection | None:
        now = time.monotonic()
        while origin.idle:
            conn = origin.idle.pop()
            if not conn.closed and now - conn.idle_since < self.IDLE_S:
                return conn
            conn.close()
        return None

    async def _request(self, method: bytes, url: str, rest: bytes, timeout_s: float,
                       sink: Callable[[int, list[tuple[bytes, bytes]] | None, bytes], None] | None = None,
                       path: bytes | None = None) -> tuple[int, bytes, float]:
        """``rest``: the headers after Host, the blank line and the body. One write per request. With ``sink``
        the answer is streamed to it (see ``relay``) and the returned body is empty. ``path`` replaces the URL's
        own (the URL then names only the origin, so the parsed-URL cache holds one entry per origin)."""
        origin, url_path = self._target(url)
        path = url_path if path is None else path
        request = b"".join((method, b" ", path, b" HTTP/1.1\r\n", origin.host_header, rest))
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.max_connections)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        async with self._slots:
            for attempt in (0, 1):
                conn = self._pooled(origin)
                reused = conn is not None
                if conn is None:
                    _, conn = await asyncio.wait_for(loop.create_connection(
                        lambda: _Connection(origin), origin.host, origin.port, ssl=origin.ssl),
                        min(self.connect_timeout_s, max(0.0, deadline - loop.time())))
                assert conn.transport is not None
                conn.waiter = waiter = loop.create_future()
                conn.received = conn.headers_done = conn.delimited = False
                conn.sink, conn.headers = sink, []
                conn.transport.write(request)
                timer = loop.call_at(deadline, conn.timed_out)
                try:
                    answer = await waiter
                except TimeoutError:
                    raise  # timed_out closed the connection
                except ConnectionError:
                    # A reused connection the pod closed before answering anything (its keep-alive ran out as
                    # we wrote): the pod never read the request, so it goes once more on a new connection.
                    if reused and not conn.received and attempt == 0:
                        continue
                    raise
                except BaseException:
                    conn.close()  # cancelled mid-response: the connection's state is unknown
                    raise
                finally:
                    timer.cancel()
                    conn.sink = None
                if conn.keep_alive and not conn.closed:
                    conn.idle_since = time.monotonic()
                    origin.idle.append(conn)
                else:
                    conn.close()
                return answer
        raise AssertionError("unreachable")

    def channel(self, url: str) -> Any:
        from services.gateway.channel import PodChannel  # it builds on this module

        origin, path = self._target(url)
        return PodChannel(origin, path, self.connect_timeout_s, self.timeout_s)

    async def post_json(self, url: str, body: bytes) -> tuple[int, bytes, float]:
        head = b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
        try:
            return await self._request(b"POST", url, head + body, self.timeout_s)
        except (OSError, asyncio.TimeoutError, httptools.HttpParserError) as exc:
            raise PodConnectionError(f"{type(exc).__name__}: {exc}") from None

    async def relay(self, method: str, origin: str, path: str, headers: list[tuple[bytes, bytes]], body: bytes,
                    sink: Callable[[int, list[tuple[bytes, bytes]] | None, bytes], None]) -> None:
        """Send ``method path`` to ``origin`` (scheme://host:port) with the given headers (Host and
        Content-Length are set here) and stream the answer to ``sink``: once ``(status, headers, b"")`` when
        the head is in, then ``(0, None, piece)`` per body piece; returns when the answer is complete. Raises
        PodConnectionError on transport failure (the sink may already have the head: the answer was cut)."""
        head = b"".join(k + b": " + v + b"\r\n" for k, v in headers)
        rest = b"%sContent-Length: %d\r\n\r\n%s" % (head, len(body), body)
        try:
            await self._request(method.encode(), origin, rest, self.timeout_s, sink, path.encode("latin-1"))
        except (OSError, asyncio.TimeoutError, httptools.HttpParserError) as exc:
            raise PodConnectionError(f"{type(exc).__name__}: {exc}") from None

    async def get(self, url: str, timeout_s: float) -> int:
        try:
            return (await self._request(b"GET", url, b"\r\n", timeout_s))[0]
        except (OSError, asyncio.TimeoutError, httptools.HttpParserError) as exc:
            raise PodConnectionError(f"{type(exc).__name__}: {exc}") from None

    async def close(self) -> None:
        for origin in self._origins.values():
            while origin.idle:
                origin.idle.pop().close()
