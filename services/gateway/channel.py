"""One long-lived, full-duplex generate stream per pod (``POST /v1/generate_stream``, see services/rollout/stream.py).

Each call is one NDJSON line of a chunked request body, and its answer comes back as one NDJSON line of
the response the moment the pod has it. Against one HTTP request per call this saves both ends the
per-request HTTP work. The lines of the calls made in one pass of the event loop (the turns of a wave of
requests, parsed together) leave in one write at the end of that pass, or once the first has waited
``MAX_HOLD_S``: one send for several calls, read by the pod in one go, so they join the same engine step.
A lone call leaves as soon as the turn that made it yields; each call's pod wait counts from when its line
left.

This is the one hand-written HTTP client in the gateway (an ``asyncio.Protocol`` with httptools' response
parser), kept because a pass of the event loop at 64 concurrent turns lasts milliseconds: a client library
can write only between passes (aiohttp's streamed request body), and the lines of the first turns of a wave
then wait for the last. docs/gateway.md has the same-run A/B against the aiohttp version.

Failure model (the same as single calls, so ``PodPool`` treats both alike): a refused connection, a
dropped stream, a stream the pod ends or refuses, or a call that times out raises ``PodConnectionError``
for the calls it carried; the next call opens a new stream. A cancelled call is aborted on the pod with an
``{"abort": [id]}`` line. A streamed call (``on_tokens``) asks the pod for its tokens as they are generated:
its delta lines go to ``on_tokens``, then its answer line resolves it as for any call.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import ssl
import time
from collections.abc import Callable
from urllib.parse import urlsplit

import httptools

from molt.net import LineSplitter
from services.gateway.transport import PodConnectionError, json_loads

PATH = "/v1/generate_stream"

MAX_HOLD_S = 0.00025
"""Longest a call line waits for the other lines of its pass of the event loop (see ``_Stream.write_line``)."""


class _Stream(asyncio.Protocol):
    """One open stream: writes call lines as chunks, parses answer lines as they arrive."""

    def __init__(self, channel: PodChannel) -> None:
        self.channel = channel
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.calls: dict[str, asyncio.Future] = {}
        self.progress: dict[str, Callable[[list[int], list[float]], None]] = {}  # streamed calls' token callbacks
        self.lines = LineSplitter()
        self.status = 0
        self.error_body: list[bytes] = []
        self.closed = False
        self.error: PodConnectionError | None = None  # why it ended
        self.out: list[bytes] = []  # chunks queued, not yet written (see write_line)
        self.first_at = 0.0  # when the first of them was queued
        self.sent_at = [0.0]  # when they leave (perf_counter), shared by their calls
        self.flush_soon = False  # a flush is scheduled for the end of this pass of the event loop

    # ---- writing

    def write_line(self, line: bytes) -> list[float]:
        """Queue ``line``. The lines queued in one pass of the event loop leave together at its end, or as soon
        as the first of them has waited ``MAX_HOLD_S`` (the other turns of a big wave take that long to get
        their lines ready). Returns the one-element list that holds when it left, once it has."""
        now = time.perf_counter()
        if not self.out:
            self.sent_at = [0.0]
            self.first_at = now
            if not self.flush_soon:
                self.flush_soon = True
                asyncio.get_running_loop().call_soon(self._end_of_pass)
        self.out.append(b"%x\r\n%s\r\n" % (len(line), line))
        sent_at = self.sent_at
        if now - self.first_at >= MAX_HOLD_S:
            self._flush()
        return sent_at

    def _end_of_pass(self) -> None:
        self.flush_soon = False
        self._flush()

    def _flush(self) -> None:
        if not self.out:
            return
        out, self.out = self.out, []
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(out[0] if len(out) == 1 else b"".join(out))
        self.sent_at[0] = time.perf_counter()

    # ---- asyncio.Protocol / httptools callbacks

    def connection_made(self, transport) -> None:
        self.transport = transport
        transport.write(
            b"POST "
            + self.channel.path
            + b" HTTP/1.1\r\n"
            + self.channel.host_header
            + self.channel.auth_header
            + b"Content-Type: application/x-ndjson\r\nTransfer-Encoding: chunked\r\n\r\n"
        )

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            # httptools wraps what a callback raised (our _BadLine) in a parser error
            bad = exc.__context__ if isinstance(exc.__context__, _BadLine) else None
            self._end(
                PodConnectionError(
                    f"malformed answer line from the pod: {bad}"
                    if bad is not None
                    else f"malformed generate stream from the pod: {exc}"
                )
            )

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        if self.status != 200:
            self.error_body.append(body)
            return
        lines = self.lines.feed(body)
        at = time.perf_counter()
        for line in lines:
            self._answer(line, at)

    def on_message_complete(self) -> None:
        if self.status != 200:
            text = b"".join(self.error_body)[:300].decode(errors="replace")
            self._end(PodConnectionError(f"generate stream refused: HTTP {self.status}: {text}"))
        else:
            self._end(PodConnectionError("the pod ended the generate stream"))

    def connection_lost(self, exc: Exception | None) -> None:
        self._end(
            PodConnectionError(
                "the pod closed the generate stream"
                if exc is None
                else f"generate stream lost: {type(exc).__name__}: {exc}"
            )
        )

    # ----

    def _answer(self, line: bytes, at: float) -> None:
        try:
            answer = json_loads(line)
            call_id = answer["id"]
            if "delta" in answer:  # a streamed call's new tokens (a call given up on has no callback left)
                on_tokens = self.progress.get(call_id)
                if on_tokens is not None:
                    on_tokens(answer["delta"]["token_ids"], answer["delta"]["logprobs"])
                return
            status = int(answer["status"])
        except (ValueError, KeyError, TypeError) as exc:
            raise _BadLine(f"{exc}: {line[:200]!r}") from None
        self.progress.pop(call_id, None)
        future = self.calls.pop(call_id, None) if isinstance(call_id, str) else None
        if future is None:
            if call_id is None:  # the pod could not read a line we sent: never guess which call it was
                raise _BadLine(f"the pod rejected a call line: {line[:300]!r}")
            return  # a call we gave up on (cancelled, timed out)
        if not future.done():
            future.set_result((status, answer, at))

    def _end(self, exc: PodConnectionError) -> None:
        """Fail every call still on this stream and close it."""
        if self.channel.stream is self:
            self.channel.stream = None
        self.closed = True
        self.error = self.error or exc
        calls, self.calls = self.calls, {}
        self.progress.clear()
        for future in calls.values():
            if not future.done():
                future.set_exception(exc)
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()


class _BadLine(Exception):
    pass


class PodChannel:
    """The generate stream to the pod at ``url`` (its base URL), opened on first use and reopened after a
    failure. ``token``: the service token the pod requires (sent as a bearer header)."""

    def __init__(self, url: str, connect_timeout_s: float, timeout_s: float, token: str | None = None) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"unsupported pod URL {url!r}: expected http(s)://HOST:PORT")
        self.host, self.port = parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)
        self.ssl = ssl.create_default_context() if parts.scheme == "https" else None
        self.host_header = f"Host: {f'[{self.host}]' if ':' in self.host else self.host}:{self.port}\r\n".encode()
        self.path = parts.path.rstrip("/").encode() + PATH.encode()
        # The service token (MOLT_INTERNAL_TOKEN) a guarded pod requires: one more line of the request head.
        self.auth_header = f"Authorization: Bearer {token}\r\n".encode() if token else b""
        self.connect_timeout_s, self.timeout_s = connect_timeout_s, timeout_s
        self.stream: _Stream | None = None
        self._opening: asyncio.Future | None = None
        self._ids = itertools.count()
        self._prefix = os.urandom(4).hex()
        self.opened = 0

    async def _open(self) -> _Stream:
        if self.stream is not None and not self.stream.closed:
            return self.stream
        if self._opening is None:
            self._opening = asyncio.ensure_future(self._connect())
        opening = self._opening
        try:
            return await asyncio.shield(opening)
        finally:
            if opening.done() and self._opening is opening:
                self._opening = None

    async def _connect(self) -> _Stream:
        loop = asyncio.get_running_loop()
        try:
            _, stream = await asyncio.wait_for(
                loop.create_connection(lambda: _Stream(self), self.host, self.port, ssl=self.ssl),
                self.connect_timeout_s,
            )
        except (TimeoutError, OSError) as exc:
            raise PodConnectionError(f"{type(exc).__name__}: {exc}") from None
        self.stream = stream
        self.opened += 1
        return stream

    async def generate(
        self, body: bytes, on_tokens: Callable[[list[int], list[float]], None] | None = None
    ) -> tuple[int, dict, float, float]:
        """``body``: one /v1/generate request. (status, answer line, sent, answered). ``on_tokens``: stream the
        call, getting its tokens and logprobs as the pod generates them.

        Raises PodConnectionError when the stream fails or the call runs past the timeout."""
        stream = await self._open()
        if stream.closed:  # it failed while this call waited for it to open
            raise stream.error or PodConnectionError("the generate stream closed as it opened")
        loop = asyncio.get_running_loop()
        call_id = f"{self._prefix}-{next(self._ids)}"
        future = loop.create_future()
        stream.calls[call_id] = future
        if on_tokens is not None:
            stream.progress[call_id] = on_tokens
            body = b'{"stream":true,' + body[1:]
        sent = stream.write_line(b'{"id":"%s",%s\n' % (call_id.encode(), body[1:]))
        timer = loop.call_at(loop.time() + self.timeout_s, self._timed_out, stream, call_id, future)
        try:
            result = await future
        except asyncio.CancelledError:
            self._abort(stream, call_id)
            raise
        finally:
            timer.cancel()
        status, answer, answered = result
        return status, answer, sent[0] or answered, answered

    def _abort(self, stream: _Stream, call_id: str) -> None:
        stream.progress.pop(call_id, None)
        if stream.calls.pop(call_id, None) is not None and not stream.closed:
            stream.write_line(b'{"abort":["%s"]}\n' % call_id.encode())

    def _timed_out(self, stream: _Stream, call_id: str, future: asyncio.Future) -> None:
        self._abort(stream, call_id)
        if not future.done():
            future.set_exception(PodConnectionError(f"no answer within {self.timeout_s:g} s"))

    def close(self) -> None:
        """Fail the calls in flight and drop the stream; the pod aborts what was still running for it."""
        stream, self.stream = self.stream, None
        if stream is not None and not stream.closed:
            stream._end(PodConnectionError("the gateway is shutting down"))
