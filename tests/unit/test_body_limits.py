"""Request bodies over ``--server.max_body_bytes`` get 413 (molt/body_limit.py): a declared Content-Length before
anything is read, a chunked body as soon as it passes the limit, in the service's own error shape; bodies within
the limit, and routes that bound their own stream, pass through untouched. The env worker, served as
``molt.serve`` serves it, refuses an oversized episode and serves the next one; the gateway keeps its own limit."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import textwrap

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from molt.agents.testing import FakeGateway
from molt.body_limit import BodyLimit, own_body_limit
from molt.config import ServerConfig, parse_settings
from molt.serve import OWN_BODY_LIMIT, uvicorn_config
from services.envs.app import build_app
from services.envs.config import EnvsSettings
from services.gateway.config import SessionConfig

LIMIT = 1000
FLAG = "--server.max_body_bytes"


def _app(handlers: dict | None = None) -> tuple[Starlette, list[int]]:
    """A tiny app echoing what it read; ``seen`` lists the body sizes its handlers got."""
    seen: list[int] = []

    async def echo(request: Request) -> Response:
        body = await request.body()
        seen.append(len(body))
        return Response(body, media_type="application/octet-stream")

    @own_body_limit
    async def stream(request: Request) -> Response:
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
        seen.append(size)
        return JSONResponse({"size": size})

    routes = [Route("/echo", echo, methods=["POST"]), Route("/stream", stream, methods=["POST"])]
    return Starlette(routes=routes, exception_handlers=handlers), seen


def _post(app, path: str, content) -> httpx.Response:
    async def go():
        transport = httpx.ASGITransport(app=BodyLimit(app, LIMIT))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.post(path, content=content)

    return asyncio.run(go())


def _chunks(total: int, size: int = 100):
    async def gen():
        for start in range(0, total, size):
            yield b"x" * min(size, total - start)

    return gen()


def _refusal(r: httpx.Response) -> dict:
    assert r.status_code == 413, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert FLAG in err["message"] and str(LIMIT) in err["message"], err
    return err


def test_a_declared_length_over_the_limit_is_refused_before_the_app_reads_anything():
    app, seen = _app()
    err = _refusal(_post(app, "/echo", b"x" * (LIMIT + 1)))
    assert err["code"] == "request_too_large" and f"{LIMIT + 1} bytes" in err["message"]
    assert seen == []


def test_a_chunked_body_is_cut_once_it_passes_the_limit():
    app, seen = _app()
    r = _post(app, "/echo", _chunks(LIMIT * 5))
    assert _refusal(r)["type"] == "invalid_request_error"
    assert seen == []  # the handler never got its body


@pytest.mark.parametrize("chunked", [False, True])
def test_bodies_within_the_limit_pass_through_unchanged(chunked):
    app, seen = _app()
    body = bytes(range(256)) * 3 + b"y" * (LIMIT - 768)
    r = _post(app, "/echo", _chunks(LIMIT) if chunked else body)
    assert r.status_code == 200 and r.content == (b"x" * LIMIT if chunked else body)
    assert seen == [LIMIT]


def test_the_413_is_in_the_apps_own_error_shape():
    async def shaped(request, exc: HTTPException):
        return JSONResponse({"error": {"message": exc.detail, "type": "mine", "code": exc.status_code}}, 413)

    app, _ = _app({HTTPException: shaped})
    for content in (b"x" * (LIMIT + 1), _chunks(LIMIT + 1)):
        assert _refusal(_post(app, "/echo", content))["type"] == "mine"


def test_a_route_that_bounds_its_own_stream_is_not_limited():
    app, seen = _app()
    for content in (_chunks(LIMIT * 5), b"x" * (LIMIT * 5)):
        r = _post(app, "/stream", content)
        assert r.status_code == 200 and r.json() == {"size": LIMIT * 5}
    assert seen == [LIMIT * 5] * 2


def test_the_setting_must_be_positive_and_is_above_the_gateways_own_limit(capsys):
    for bad in ("0", "-1"):
        with pytest.raises(SystemExit) as exc:
            parse_settings(EnvsSettings, ["--server.max_body_bytes", bad], prog="envs")
        assert exc.value.code == 2
        assert FLAG in capsys.readouterr().err
    # What the gateway accepts (by default) and forwards fits; the gateway is not limited twice.
    assert ServerConfig().max_body_bytes >= SessionConfig().max_body_bytes
    assert "gateway" in OWN_BODY_LIMIT
    with pytest.raises(ValueError, match=FLAG):
        BodyLimit(_app()[0], 0)


AGENT = textwrap.dedent("""
    from molt.agents import Env, Result, StepEnvRunner

    class MyEnv(Env):
        async def step(self, state):
            return Result(reward=1.0)

    class AgentRunner(StepEnvRunner):
        def __init__(self):
            super().__init__(MyEnv)
""")


@contextlib.asynccontextmanager
async def _served(app, server: ServerConfig):
    """``app`` served by a real uvicorn with the services' config (molt.serve.uvicorn_config) on loopback."""
    srv = uvicorn.Server(uvicorn_config(app, server))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    task = asyncio.ensure_future(srv.serve(sockets=[sock]))
    try:
        while not srv.started:
            assert not task.done(), task
            await asyncio.sleep(0.02)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        srv.should_exit = True
        await asyncio.wait_for(task, 10)
        sock.close()


def test_the_env_worker_refuses_an_oversized_episode_and_serves_the_next(tmp_path):
    (tmp_path / "agent.py").write_text(AGENT)
    limit = 64 << 10

    async def go():
        fake = FakeGateway(policy=lambda prompt, turn: "ok")
        settings = EnvsSettings(
            agent=[f"echo={tmp_path / 'agent.py'}"],
            gateway={"url": "http://fake"},
            envs={"max_concurrency": 4, "episode_timeout_s": 5.0},
            server={"max_body_bytes": limit},
        )
        app = build_app(settings, gateway_transport=httpx.ASGITransport(app=fake.app))
        episode = {"agent": "echo", "prompt": "say", "label": 1.0, "group_id": "g"}
        big = json.dumps({**episode, "prompt": "x" * limit}).encode()
        async with _served(app, settings.server) as url, httpx.AsyncClient(base_url=url, timeout=30) as client:
            declared = await client.post("/v1/episodes:run", content=big)

            async def chunked():
                for start in range(0, len(big), 4096):
                    yield big[start : start + 4096]

            streamed = await client.post("/v1/episodes:run", content=chunked())
            # Only a head announcing 10 GB: the answer comes without waiting for any of it.
            reader, writer = await asyncio.open_connection("127.0.0.1", int(url.rsplit(":", 1)[1]))
            writer.write(b"POST /v1/episodes:run HTTP/1.1\r\nHost: w\r\nContent-Length: 10000000000\r\n\r\n")
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            writer.close()
            ok = await client.post("/v1/episodes:run", json=episode)
        return declared, streamed, head, ok, fake

    declared, streamed, head, ok, fake = asyncio.run(go())
    assert head.startswith(b"HTTP/1.1 413 "), head
    for r in (declared, streamed):
        assert r.status_code == 413, r.text
        err = r.json()["error"]  # the worker's error shape: its code is the status
        assert err["code"] == 413 and err["type"] == "invalid_request_error" and FLAG in err["message"], err
    assert ok.status_code == 200 and ok.json()["status"] == "ok", ok.text
    assert len(fake.sessions) == 1  # only the normal episode reached the gateway
