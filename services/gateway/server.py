"""uvicorn's httptools protocol with one socket write per response instead of two, and a cheaper way to send a
complete response.

uvicorn writes a response's status line and headers on ``http.response.start`` and the body on
``http.response.body``: two ``send`` calls, and on loopback often two wake-ups of the client. The gateway
answers every turn with one complete body, so here the header bytes wait for the body and leave with it.
Headers that no body follows in the same event-loop step (a stream whose first chunk is slow, an error
path) are flushed at the end of that step, so nothing is delayed past it and the byte order never changes.

A response whose whole body is known when it starts (every non-streamed answer) can skip both ASGI
``send`` calls: ``scope["extensions"]["molt.send_whole"](status, headers, body)`` writes it at once with
uvicorn's own header checks and keep-alive bookkeeping, and no held-head flush callback. A rollout pod
finishes the turns of one engine step together, so the gateway answers them in bursts, one after another
on one thread: what each answer costs is what the last one in a burst waits (``edge.py`` uses it).
Measured with ``bench/gateway.py``: see BENCHMARKS.md "Gateway overhead".
"""

from __future__ import annotations

import asyncio
from functools import partial

from uvicorn.protocols.http.httptools_impl import HEADER_RE, HEADER_VALUE_RE, STATUS_LINE, HttpToolsProtocol
from uvicorn.protocols.utils import get_client_addr, get_path_with_query_string


class _CoalescingTransport:
    """Forwards to the real transport; a write that is a response head is held until the next write."""

    __slots__ = ("_transport", "_loop", "_held")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._held: bytes | None = None

    def write(self, data: bytes) -> None:
        if self._held is not None:
            data, self._held = self._held + data, None
        elif data[:5] == b"HTTP/" and data[-4:] == b"\r\n\r\n":
            self._held = data
            self._loop.call_soon(self.flush)
            return
        self._transport.write(data)

    def flush(self) -> None:
        if self._held is not None:
            data, self._held = self._held, None
            if not self._transport.is_closing():
                self._transport.write(data)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def __getattr__(self, name: str):
        return getattr(self._transport, name)


class CoalescingHttpToolsProtocol(HttpToolsProtocol):
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(_CoalescingTransport(transport, self.loop))  # type: ignore[arg-type]

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None and cycle.scope is self.scope:  # not an upgrade
            self.scope["extensions"] = {"molt.send_whole": partial(self._send_whole, cycle)}

    def _send_whole(self, cycle, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> bool:
        """What ``cycle.send`` does for a start and a last body message, in one write. False (nothing done) when
        the two ASGI messages must be sent instead: the response started, writing is paused, a HEAD request,
        or headers that set the framing (only ``content-length`` equal to the body's length is taken here)."""
        if cycle.response_started or cycle.flow.write_paused or cycle.scope["method"] == "HEAD":
            return False
        if cycle.disconnected:
            return True  # as cycle.send: the client is gone, nothing to write
        if cycle.access_log:
            scope = cycle.scope
            cycle.access_logger.info('%s - "%s %s HTTP/%s" %d', get_client_addr(scope), scope["method"],
                                     get_path_with_query_string(scope), scope["http_version"], status)
        content = [STATUS_LINE[status]]
        length = None
        for name, value in (*self.server_state.default_headers, *headers):
            if HEADER_RE.search(name) or HEADER_VALUE_RE.search(value):
                raise RuntimeError("Invalid HTTP header name or value.")
            name = name.lower()
            if name == b"content-length":
                length = value
            elif name in (b"transfer-encoding", b"connection"):
                return False
            content += (name, b": ", value, b"\r\n")
        if length is None or length != b"%d" % len(body):
            return False
        if not cycle.keep_alive:
            content.append(b"connection: close\r\n")
        content += (b"\r\n", body)
        cycle.response_started = cycle.response_complete = True
        cycle.waiting_for_100_continue = False
        cycle.transport.write(b"".join(content))
        cycle.message_event.set()
        if not cycle.keep_alive:
            cycle.transport.close()
        cycle.on_response()
        return True
