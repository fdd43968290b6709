"""Slow clients must not starve a server: a time limit on a connection's first request head, and a cap on the
connections still waiting for one.

uvicorn starts its keep-alive timer only once a response is done, so a client that connects and sends a
request head one byte at a time (or nothing at all) holds a connection, and a file descriptor, for as long as
it likes; a few thousand such clients exhaust the process's descriptors and nobody else gets in. Its
``limit_concurrency`` counts those connections too, so it would turn everyone away instead.

``guarded(inner, header_timeout_s, max_pending)`` wraps uvicorn's HTTP protocol class ``inner`` in
``GuardedProtocol`` (passed as ``uvicorn.Config(http=...)``), an ``asyncio.Protocol`` that forwards every call
to it and closes a connection whose first request head (up to its blank line) has not arrived within
``header_timeout_s``; when more than ``max_pending`` connections are waiting for their first head, the one that
has waited longest is closed.
A client that sends its request at once is past this in one read and never affected. Later requests on a
kept-alive connection are uvicorn's (its keep-alive timeout); request bodies are bounded by the app
(``body_timeout``).
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from typing import Any

GRACE_S = 0.05


class _Pending:
    """The connections waiting for their first request head, oldest first."""

    def __init__(self, header_timeout_s: float, max_pending: int) -> None:
        self.header_timeout_s = header_timeout_s
        self.max_pending = max_pending
        self.waiting: OrderedDict[GuardedProtocol, float] = OrderedDict()
        self.closed_slow = 0  # closed for taking too long
        self.closed_over_cap = 0  # closed to make room


class GuardedProtocol(asyncio.Protocol):
    inner_class: Any = None
    pending: _Pending

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.inner = self.inner_class(*args, **kwargs)
        self.transport: asyncio.Transport | None = None
        self.tail = b""  # the last bytes seen, for a blank line split across reads
        self.timer: asyncio.TimerHandle | None = None
        self.graced = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvicorn serves HTTP over stream transports
        pending = self.pending
        pending.waiting[self] = time.monotonic()
        self.timer = asyncio.get_running_loop().call_later(pending.header_timeout_s, self._too_slow)
        while len(pending.waiting) > pending.max_pending:
            oldest, _ = pending.waiting.popitem(last=False)
            pending.closed_over_cap += 1
            oldest._drop()
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self.timer is not None:
            seen = self.tail + data
            if b"\r\n\r\n" in seen or b"\n\n" in seen:
                self._release()
            else:
                self.tail = seen[-3:]
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._release()
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def _release(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
            self.pending.waiting.pop(self, None)

    def _too_slow(self) -> None:
        # uvloop runs due timers before it reads the sockets, so after a stall of this process (a GIL-heavy
        # engine step, a swap-in) a head that already arrived would be read only after this fires: give the
        # reads one short loop pass before judging the client.
        if not self.graced:
            self.graced = True
            self.timer = asyncio.get_running_loop().call_later(GRACE_S, self._too_slow)
            return
        self.pending.closed_slow += 1
        self.pending.waiting.pop(self, None)
        self._drop()

    def _drop(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.transport is not None:
            self.transport.abort()  # nothing to answer: no request was made


def guarded(inner: type[asyncio.Protocol], header_timeout_s: float, max_pending: int) -> type[GuardedProtocol]:
    """A protocol class for ``uvicorn.Config(http=...)`` that wraps ``inner`` (uvicorn's HTTP protocol); its
    ``pending`` attribute holds the shared counters."""
    pending = _Pending(header_timeout_s, max_pending)
    return type("GuardedHttp", (GuardedProtocol,), {"inner_class": inner, "pending": pending})
