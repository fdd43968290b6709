"""The gateway's HTTP server (services/gateway/server.py) under its edge (edge.py), on a real loopback socket.

A complete response is written in one go by ``molt.send_whole``; these tests read the raw bytes to check that
it frames responses exactly as uvicorn's own two-message path does (keep-alive, pipelining, ``Connection:
close``, HTTP/1.0, HEAD) and that streams and errors still take the ASGI path.
"""

from __future__ import annotations

import asyncio
import json

import pytest
import uvicorn
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route, Router

from molt.net import listening_socket
from services.gateway.__main__ import server_config
from services.gateway.config import GatewaySettings
from services.gateway.edge import Edge, Endpoint
from services.gateway.metrics import gateway_metrics
from services.gateway.routes import TurnJSON
from services.gateway.server import CoalescingHttpToolsProtocol

KEEP_ALIVE_S = 1.5  # long enough that the other tests never idle past it, even on a loaded machine


async def _turn(request: Request):
    body = await request.json()
    request.state.pod_wait_s = 0.001
    whole = "molt.send_whole" in request.scope.get("extensions", {})
    return TurnJSON({"echo": body, "whole": whole, "text": "héllo"}, 7)


async def _plain(request: Request):
    return JSONResponse({"ok": True})


async def _stream(request: Request):
    async def chunks():
        for i in range(3):
            yield f"data: {i}\n\n".encode()
            await asyncio.sleep(0)
    return StreamingResponse(chunks(), media_type="text/event-stream")


async def _broken_stream(request: Request):
    async def chunks():
        raise RuntimeError("boom before the first chunk")
        yield b""  # pragma: no cover
    return StreamingResponse(chunks(), media_type="text/event-stream")


@pytest.fixture
async def server():
    router = Router([
        Route("/s/x/v1/chat/completions", Endpoint(_turn), methods=["POST"]),
        Route("/plain", Endpoint(_plain), methods=["GET"]),
        Route("/stream", Endpoint(_stream), methods=["GET"]),
        Route("/v1/broken", Endpoint(_broken_stream), methods=["GET"]),
    ])
    metrics = gateway_metrics()
    app = Edge(router, metrics, lambda: 3)
    sock = listening_socket("test", "127.0.0.1", 0)
    config = server_config(app, GatewaySettings(server={"log_level": "warning", "keep_alive_s": KEEP_ALIVE_S}))
    config.lifespan = "off"
    srv = uvicorn.Server(config)
    task = asyncio.create_task(srv.serve(sockets=[sock]))
    while not srv.started:
        await asyncio.sleep(0.01)
    yield sock.getsockname()[1], metrics
    srv.should_exit = True
    await task


async def _read_response(reader: asyncio.StreamReader) -> tuple[str, dict[str, str], bytes]:
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
    status, *lines = head[:-4].split("\r\n")
    headers: dict[str, str] = {}
    for line in lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    if "content-length" in headers:
        body = await reader.readexactly(int(headers["content-length"]))
    elif headers.get("transfer-encoding") == "chunked":
        body = b""
        while True:
            size = int((await reader.readuntil(b"\r\n"))[:-2], 16)
            chunk = await reader.readexactly(size + 2)
            if size == 0:
                break
            body += chunk[:-2]
    else:
        body = b""
    return status, headers, body


def _post(body: dict, extra: str = "", version: str = "1.1") -> bytes:
    raw = json.dumps(body).encode()
    return (f"POST /s/x/v1/chat/completions HTTP/{version}\r\nHost: t\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(raw)}\r\n{extra}\r\n").encode() + raw


async def test_whole_responses_keep_alive_and_pipelined(server):
    port, metrics = server
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(_post({"n": 1}) + _post({"n": 2}))  # two requests before any answer: pipelined
    await writer.drain()
    for n in (1, 2):
        status, headers, body = await _read_response(reader)
        assert status == "HTTP/1.1 200 OK"
        assert json.loads(body) == {"echo": {"n": n}, "whole": True, "text": "héllo"}
        assert headers["content-type"] == "application/json"
        assert headers["x-molt-policy-version"] == "7"  # the handler's, not the edge's default (3)
        assert headers["server-timing"].startswith("gateway;dur=") and "pod;dur=1.000" in headers["server-timing"]
        assert "date" in headers and "connection" not in headers
    writer.write(b"GET /plain HTTP/1.1\r\nHost: t\r\n\r\n")  # the same connection stays usable
    status, headers, body = await _read_response(reader)
    assert (status, json.loads(body), headers["x-molt-policy-version"]) == ("HTTP/1.1 200 OK", {"ok": True}, "3")
    writer.close()
    await asyncio.sleep(0.05)  # requests are recorded after the response leaves
    text = metrics.render()[0].decode()
    assert 'molt_gateway_requests_total{code="200",wire="openai"} 2.0' in text


@pytest.mark.parametrize("ask", ["close", "http/1.0"])
async def test_whole_response_that_closes_the_connection(server, ask):
    port, _ = server
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(_post({"n": 3}, "Connection: close\r\n") if ask == "close" else _post({"n": 3}, version="1.0"))
    status, headers, body = await _read_response(reader)
    assert status.endswith("200 OK") and json.loads(body)["echo"] == {"n": 3}
    assert headers["connection"] == "close"
    assert await reader.read() == b""  # and the server closed it
    writer.close()


async def test_head_stream_and_error_take_the_asgi_path(server):
    port, _ = server
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"HEAD /plain HTTP/1.1\r\nHost: t\r\n\r\n")
    head = await reader.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK") and b"content-length: 11" in head
    writer.write(b"GET /stream HTTP/1.1\r\nHost: t\r\n\r\n")  # no body came after the HEAD's headers
    status, headers, body = await _read_response(reader)
    assert headers["transfer-encoding"] == "chunked" and body == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
    # A stream that fails before its first chunk has sent nothing yet: the client gets the wire's error shape.
    writer.write(b"GET /v1/broken HTTP/1.1\r\nHost: t\r\n\r\n")
    status, headers, body = await _read_response(reader)
    assert status == "HTTP/1.1 500 Internal Server Error"
    assert json.loads(body)["error"]["type"] == "server_error"
    writer.close()


async def test_the_gateways_server_config(server):
    port, _ = server
    config = server_config(None, GatewaySettings())
    assert config.http is CoalescingHttpToolsProtocol
    # Longer than clients keep an idle connection (httpx 5 s, aiohttp 15 s): the client closes first, so it never
    # writes a request into a connection the server is closing. uvicorn's own default is 5 s.
    assert config.timeout_keep_alive == GatewaySettings().server.keep_alive_s == 75.0
    # The setting reaches the server: an idle connection stays usable until keep_alive_s, then the server closes it.
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    for _ in range(2):
        writer.write(b"GET /plain HTTP/1.1\r\nHost: t\r\n\r\n")
        status, _, body = await _read_response(reader)
        assert (status, json.loads(body)) == ("HTTP/1.1 200 OK", {"ok": True})
        await asyncio.sleep(KEEP_ALIVE_S / 3)
    loop = asyncio.get_running_loop()
    idle_from = loop.time() - KEEP_ALIVE_S / 3
    assert await asyncio.wait_for(reader.read(), 10) == b""
    assert loop.time() - idle_from >= KEEP_ALIVE_S * 0.9
    writer.close()
