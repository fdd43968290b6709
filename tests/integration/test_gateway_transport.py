"""The gateway's pod HTTP client (aiohttp) against real loopback servers that answer in every shape HTTP/1.1
allows: what the gateway relies on, and how each failure is typed."""

from __future__ import annotations

import asyncio

import pytest

from services.gateway.transport import HttpTransport, PodConnectionError


class Server:
    """A raw asyncio HTTP server: ``answer(request_bytes, nth)`` returns what to write, or None to hang up."""

    def __init__(self, answer) -> None:
        self.answer = answer
        self.requests: list[bytes] = []
        self.connections = 0
        self.writers: list[asyncio.StreamWriter] = []

    async def __aenter__(self) -> Server:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc) -> None:
        for w in self.writers:
            w.close()
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.writers.append(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    (
                        int(line.split(b":")[1])
                        for line in head.split(b"\r\n")
                        if line.lower().startswith(b"content-length:")
                    ),
                    0,
                )
                body = await reader.readexactly(length)
                self.requests.append(head + body)
                out = self.answer(head + body, len(self.requests))
                if out is None:
                    writer.close()
                    return
                if isinstance(out, float):
                    await asyncio.sleep(out)
                    continue
                writer.write(out)
                await writer.drain()
                if b"connection: close" in out.lower():
                    writer.close()
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()


def ok(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n%s\r\n%s" % (len(body), extra, body)


async def test_post_reuses_one_keep_alive_connection_and_sends_a_well_formed_request():
    async with Server(lambda req, n: ok(b'{"n": %d}' % n)) as srv:
        t = HttpTransport(16, 5.0, 1.0)
        for i in range(1, 4):
            assert (await t.post_json(srv.url + "/v1/generate", b'{"x": 1}'))[:2] == (200, b'{"n": %d}' % i)
        assert srv.connections == 1
        head, _, body = srv.requests[0].partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        assert lines[0] == b"POST /v1/generate HTTP/1.1" and body == b'{"x": 1}'
        assert b"Host: 127.0.0.1:" + srv.url.rsplit(":", 1)[1].encode() in lines
        assert b"Content-Type: application/json" in lines and b"Content-Length: 8" in lines
        assert (await t.get(srv.url + "/readyz", 1.0))[0] == 200
        assert srv.requests[3].startswith(b"GET /readyz HTTP/1.1\r\n")
        await t.close()


async def test_chunked_close_delimited_and_error_statuses():
    answers = {
        1: b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n",
        2: b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 4\r\n\r\nbusy",
        3: b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nuntil-eof",
    }
    async with Server(lambda req, n: answers[n]) as srv:
        t = HttpTransport(16, 5.0, 1.0)
        assert (await t.post_json(srv.url + "/a", b"{}"))[:2] == (200, b"abcde")
        assert (await t.post_json(srv.url + "/a", b"{}"))[:2] == (503, b"busy")
        assert (await t.post_json(srv.url + "/a", b"{}"))[:2] == (200, b"until-eof")
        await t.close()


async def test_a_fresh_connection_that_is_dropped_fails_the_pod():
    async with Server(lambda req, n: None) as srv:
        t = HttpTransport(16, 5.0, 1.0)
        with pytest.raises(PodConnectionError, match="Disconnected"):
            await t.post_json(srv.url + "/a", b"{}")
        assert len(srv.requests) == 1  # a request that may have been read is never resent
        await t.close()


async def test_timeout_refused_and_malformed_answers_are_connection_errors():
    async with Server(lambda req, n: 5.0 if n == 1 else b"NOT HTTP AT ALL\r\n\r\n") as srv:
        t = HttpTransport(16, 0.2, 1.0)
        with pytest.raises(PodConnectionError, match="TimeoutError"):
            await t.post_json(srv.url + "/a", b"{}")
        with pytest.raises(PodConnectionError, match="ClientResponseError|Disconnected"):
            await t.post_json(srv.url + "/a", b"{}")
        url = srv.url
    with pytest.raises(PodConnectionError):
        await HttpTransport(16, 1.0, 1.0).post_json(url + "/a", b"{}")  # nothing listens there any more


async def test_concurrent_requests_each_get_their_own_answer():
    async with Server(lambda req, n: ok(req.partition(b"\r\n\r\n")[2])) as srv:
        t = HttpTransport(8, 5.0, 1.0)
        bodies = [b'{"i": %d}' % i for i in range(64)]
        got = await asyncio.gather(*(t.post_json(srv.url + "/a", b) for b in bodies))
        assert [b for _, b, _ in got] == bodies
        assert srv.connections <= 8  # max_connections bounds the connections in use
        await t.close()


async def test_relay_streams_the_answer_as_it_arrives_and_reports_a_cut():
    """HttpTransport.relay (the gateway replicas' forwarding): the head, then each body piece, reach the sink
    as the server sends them, over the same keep-alive pool; a connection dropped mid-answer is an error."""
    gate = asyncio.Event()
    seen: list = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:
                return
            length = next(
                int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")
            )
            body = await reader.readexactly(length)
            seen.append(head + body)
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                b"7\r\ndata: 1\r\n"
            )
            await writer.drain()
            await gate.wait()
            if b"/cut" in head:
                writer.close()
                return
            writer.write(b"7\r\ndata: 2\r\n0\r\n\r\n")
            await writer.drain()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    t = HttpTransport(16, 5.0, 1.0)
    got: list = []
    try:
        call = asyncio.ensure_future(
            t.relay(
                "POST",
                url,
                "/s/x/v1/chat/completions",
                [(b"authorization", b"Bearer k")],
                b'{"stream": true}',
                lambda *piece: got.append(piece),
            )
        )
        for _ in range(100):  # the head and the first piece arrive before the server sends the rest
            if len(got) == 2:
                break
            await asyncio.sleep(0.01)
        assert got[0][0] == 200 and (b"content-type", b"text/event-stream") in got[0][1]
        assert got[1] == (0, None, b"data: 1")
        gate.set()
        await call
        assert got[2:] == [(0, None, b"data: 2")]
        request = seen[0].split(b"\r\n")
        assert request[0] == b"POST /s/x/v1/chat/completions HTTP/1.1" and b"authorization: Bearer k" in request
        assert b"Content-Length: 16" in request and seen[0].endswith(b'{"stream": true}')
        got.clear()
        with pytest.raises(PodConnectionError):
            await t.relay("GET", url, "/cut", [], b"", lambda *piece: got.append(piece))
        assert got[0][0] == 200 and got[1] == (0, None, b"data: 1")  # the head was relayed, then the cut
    finally:
        await t.close()
        server.close()
