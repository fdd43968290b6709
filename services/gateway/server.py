"""uvicorn's httptools protocol with one socket write per response instead of two.

uvicorn writes a response's status line and headers on ``http.response.start`` and the body on
``http.response.body``: two ``send`` calls, and on loopback often two wake-ups of the client. The gateway
answers every turn with one complete body, so here the header bytes wait for the body and leave with it.
Headers that no body follows in the same event-loop step (a stream whose first chunk is slow, an error
path) are flushed at the end of that step, so nothing is delayed past it and the byte order never changes.
Measured with ``bench/gateway.py --instant-pod``: see BENCHMARKS.md "Gateway overhead".
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


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
