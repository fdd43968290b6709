"""Who may call what, on every listening surface, as the docs promise it (README, docs/weightsync.md,
docs/gateway.md, docs/envs.md, docs/deploy.md): weight changes need the weight-sync token, gateway routes need
an API key, credentials are compared in constant time, no secret reaches an answer, a log line, /metrics or
--dry-run, and slow clients cannot hold connections (molt/serve_guard.py). In-process apps over fakes, plus a
real uvicorn server on loopback where the guard's sockets are the thing under test."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import grpc
import httpx
import pytest
import uvicorn
from fastapi.testclient import TestClient
from test_rollout_routes import FakeEngine

from molt.agents.testing import FakeGateway
from molt.config import MASK, ServerConfig, iter_fields, mask_secrets
from molt.serve import uvicorn_config
from molt.weightsync.server import start_weightsync_server
from molt.weightsync.wire import SERVICE
from services.envs.app import build_app as build_envs_app
from services.envs.config import EnvsSettings
from services.gateway.config import GatewaySettings
from services.gateway.replicas import Replicas
from services.rollout.app import build_app as build_rollout_app
from services.rollout.config import RolloutSettings
from tests.gateway_testlib import scripted_gateway

TOKEN = "wt-5ecret-0123456789abcdef"  # the weight-sync token in these tests
KEY = "sk-gw-5ecret-key-42"  # a gateway API key
INTERNAL = "it-5ecret-0123456789abcdef"  # the service token (MOLT_INTERNAL_TOKEN)
WRONG = "wrong-but-distinctive-credential-77"  # what a caller without the credential offers
PROBES = ("/healthz", "/readyz", "/metrics")


def _rollout_settings(host: str = "0.0.0.0") -> RolloutSettings:
    return RolloutSettings.model_validate({"model": {"path": "/fake"}, "server": {"host": host}})


# ---------------------------------------------------------------- rollout pod: weight changes need the token


async def test_reload_is_refused_before_its_body_is_read(monkeypatch):
    """docs/weightsync.md: without the token, 401 (OpenAI error body, WWW-Authenticate: Bearer) before the body
    is read. A receive that never answers proves the body was not awaited: a read would hang the call."""
    monkeypatch.setenv("MOLT_WEIGHTS_TOKEN", TOKEN)
    app = build_rollout_app(_rollout_settings(), engine=FakeEngine())
    reads = []

    async def receive():
        reads.append(1)
        await asyncio.Event().wait()

    for headers in ([], [(b"authorization", f"Bearer {WRONG}".encode())]):
        sent: list[dict] = []

        async def send(message, sent=sent):
            sent.append(message)

        scope = {
            "type": "http",
            "method": "POST",
            "path": "/v1/weights/reload",
            "raw_path": b"/v1/weights/reload",
            "query_string": b"",
            "root_path": "",
            "headers": [(b"content-type", b"application/json"), (b"content-length", b"1000"), *headers],
            "http_version": "1.1",
            "scheme": "http",
            "server": ("pod", 8000),
            "client": ("10.0.0.9", 4242),
        }
        await asyncio.wait_for(app(scope, receive, send), 5)
        start = sent[0]
        body = b"".join(m.get("body", b"") for m in sent[1:])
        assert start["status"] == 401 and (b"www-authenticate", b"Bearer") in start["headers"]
        assert json.loads(body)["error"]["type"] == "authentication_error"
        assert TOKEN.encode() not in body and WRONG.encode() not in body
    assert reads == []


class _SpyEngine(FakeEngine):
    """A fake engine that records every member a weight-sync handler touches once ``armed``."""

    armed = False

    def __getattribute__(self, name):
        if name not in ("armed", "touched") and not name.startswith("__") and object.__getattribute__(self, "armed"):
            object.__getattribute__(self, "touched").append(name)
        return object.__getattribute__(self, name)

    def __init__(self) -> None:
        super().__init__()
        self.touched: list[str] = []


async def test_every_weightsync_rpc_is_refused_without_the_token_before_a_handler_runs(monkeypatch):
    """docs/weightsync.md: every WeightSync RPC (Begin, Push, Commit, Abort, Status, InitCollective) carries the
    bearer token; any other call is UNAUTHENTICATED before a handler runs. Raw bytes are sent: the refusal must
    not depend on the request even parsing. The refusal names the variable, never the token."""
    monkeypatch.delenv("MOLT_WEIGHTS_TOKEN", raising=False)
    engine = _SpyEngine()
    server, port = await start_weightsync_server(engine, "127.0.0.1", 0, token=TOKEN)
    engine.armed = True
    offered = [None, f"Bearer {WRONG}", f"Bearer {TOKEN}x", f"Bearer {TOKEN[:-1]}", f"bearer {TOKEN}", TOKEN]
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            for header in offered:
                metadata = None if header is None else (("authorization", header),)
                calls = {m: channel.unary_unary(f"/{SERVICE}/{m}") for m in ("Begin", "Commit", "Abort", "Status")}
                calls["InitCollective"] = channel.unary_unary(f"/{SERVICE}/InitCollective")
                for name, call in calls.items():
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await call(b"\x08\x07", metadata=metadata, timeout=5)
                    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, (name, header)
                    assert TOKEN not in (err.value.details() or "")
                push = channel.stream_unary(f"/{SERVICE}/Push")
                # The server refuses before it reads the stream; a client still sending then may see its own send
                # fail ("Internal error from Core") instead of the refusal. Such a call is tried again.
                for _ in range(5):
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await push(iter([b"\x0a\x01x"] * 3), metadata=metadata, timeout=5)
                    if err.value.code() != grpc.StatusCode.INTERNAL:
                        break
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, ("Push", header)
            refused_touched = list(engine.touched)
            status = channel.unary_unary(f"/{SERVICE}/Status")
            await status(b"", metadata=(("authorization", f"Bearer {TOKEN}"),), timeout=5)  # the spy sees a handler
    finally:
        await server.stop(0)
        engine.armed = False
    assert refused_touched == [] and engine.touched


def test_credentials_are_compared_in_constant_time(monkeypatch):
    """docs/weightsync.md (tokens compared with hmac.compare_digest) and the gateway's API keys: every check of
    an offered credential goes through hmac.compare_digest, never ``==``."""
    from services.gateway.routes import Handlers

    compared: list[tuple] = []
    real = hmac.compare_digest

    def spy(a, b):
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    from molt.weightsync.auth import bearer_matches

    assert bearer_matches(f"Bearer {TOKEN}", TOKEN) and not bearer_matches(f"Bearer {WRONG}", TOKEN)
    want = f"Bearer {TOKEN}".encode()
    assert compared == [(want, want), (f"Bearer {WRONG}".encode(), want)]

    settings = SimpleNamespace(  # just what Handlers.__init__ reads
        auth=SimpleNamespace(api_keys=["k-one", KEY]),
        session=SimpleNamespace(max_body_bytes=1 << 20),
        gateway=SimpleNamespace(fetch_images=False),
        served_model_name="policy",
    )
    compared.clear()
    h = Handlers(SimpleNamespace(settings=settings))  # type: ignore[arg-type]
    request = type("R", (), {"headers": {"authorization": f"Bearer {KEY}"}})()
    assert h.owner(request) == KEY  # type: ignore[arg-type]
    assert (KEY.encode(), KEY.encode()) in compared and all(isinstance(a, bytes) for a, _ in compared)


def test_the_weight_token_is_never_a_flag_and_never_printed(monkeypatch):
    """docs/weightsync.md: MOLT_WEIGHTS_TOKEN is read from the environment only, never a flag (out of ``ps`` and
    --dry-run): no service or push CLI has a token field, and a pod's --dry-run with it set prints none of it."""
    from services.trainer.config import TrainerSettings
    from services.trainer.push import PushSettings

    for model in (RolloutSettings, TrainerSettings, PushSettings):
        names = [dotted for dotted, _, _ in iter_fields(model)]
        assert not [n for n in names if n.rsplit(".", 1)[-1] in ("token", "weights_token", "auth_token")], model
    out = subprocess.run(
        [sys.executable, "-m", "services.rollout", "--model.path", "m", "--host", "0.0.0.0", "--dry-run"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "MOLT_WEIGHTS_TOKEN": TOKEN, "MOLT_INTERNAL_TOKEN": INTERNAL},  # a public address
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert all(t not in out.stdout and t not in out.stderr for t in (TOKEN, INTERNAL))


def test_the_pods_open_routes_and_errors_reveal_no_token(monkeypatch, caplog):
    """The unauthenticated routes (/healthz, /readyz, /metrics, version, stats, expected weights), routing's
    404/405 and a refused reload show neither the pod's token nor the one a caller offered; nor do the logs."""
    monkeypatch.setenv("MOLT_WEIGHTS_TOKEN", TOKEN)
    caplog.set_level(logging.DEBUG)
    with TestClient(build_rollout_app(_rollout_settings(), engine=FakeEngine())) as client:
        answers = [client.get(p) for p in (*PROBES, "/v1/version", "/v1/stats", "/v1/weights/expected", "/nope")]
        answers.append(client.get("/v1/weights/reload"))  # 405
        for headers in ({}, {"Authorization": f"Bearer {WRONG}"}, {"Authorization": WRONG}):
            r = client.post("/v1/weights/reload", json={"path": "/m", "version": 1}, headers=headers)
            assert r.status_code == 401
            answers.append(r)
    assert [a.status_code for a in answers[:3]] == [200, 200, 200]
    for a in answers:
        text = a.text + json.dumps(dict(a.headers))
        assert TOKEN not in text and WRONG not in text, a.request.url
    assert TOKEN not in caplog.text and WRONG not in caplog.text


# ---------------------------------------------------------------- gateway: every route but the probes needs a key


def _gateway(chat_model, **sections):
    script = lambda prompt, sp: chat_model.encode("Hi.<|im_end|>")  # noqa: E731
    return scripted_gateway(chat_model, script, ["http://pod-a:1"], **sections)


async def test_every_gateway_route_but_the_probes_needs_a_key(chat_model, caplog):
    """docs/gateway.md: with --auth.api_keys, ``Authorization: Bearer KEY`` or ``x-api-key: KEY``, else 401 in
    the wire's shape. Every route the app serves is walked (a new route cannot slip past), with no key and a
    wrong one; neither the keys nor the offered one appear in an answer, in /metrics or in the logs."""
    caplog.set_level(logging.DEBUG)
    app, _, http = _gateway(chat_model, auth={"api_keys": ["k-other", KEY]})
    walked = 0
    for route in app.routes:
        for method in sorted(route.methods - {"HEAD"}):
            path = route.path.replace("{sid}", "0123abcd")
            for headers in ({}, {"authorization": f"Bearer {WRONG}"}, {"x-api-key": WRONG}, {"authorization": KEY}):
                r = await http.request(method, path, headers=headers, json={} if method == "POST" else None)
                if route.path in PROBES:
                    assert r.status_code in (200, 503), (method, path)
                    continue
                assert r.status_code == 401, (method, path, headers, r.text)
                err = r.json()["error"]
                anthropic_wire = path.endswith(("/messages", "/count_tokens"))
                assert err["type"] == "authentication_error" if anthropic_wire else err["code"] == "invalid_api_key"
                assert WRONG not in r.text and KEY not in r.text
            walked += 1
    assert walked >= 20
    ok = await http.post("/v1/sessions", json={}, headers={"x-api-key": KEY})
    assert ok.status_code == 201
    ok = await http.get("/v1/models", headers={"authorization": f"Bearer {KEY}"})
    assert ok.status_code == 200
    for path in PROBES:
        r = await http.get(path)
        assert KEY not in r.text and "k-other" not in r.text and WRONG not in r.text
    assert KEY not in caplog.text and WRONG not in caplog.text and "k-other" not in caplog.text


async def test_a_request_for_another_replicas_session_is_checked_here_first(chat_model):
    """docs/gateway.md (several replicas): a request is checked like any other (key, body size) before it is
    forwarded: without a key it is a 401 here, and an oversized body a 413, never relayed to the replica named."""
    public = {"public_url": "http://10.0.0.1:8000"}
    _, _, http = _gateway(chat_model, auth={"api_keys": [KEY]}, replica=public, session={"max_body_bytes": 4096})
    sid = Replicas("http://10.0.0.2:8000", [KEY]).new_session_id()  # signed with the shared keys: it is followed
    r = await http.post(f"/s/{sid}/v1/chat/completions", json={"messages": []})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = await http.post(
        f"/s/{sid}/v1/chat/completions", content=b"x" * 10_000, headers={"authorization": f"Bearer {KEY}"}
    )
    assert r.status_code == 413 and r.headers["connection"] == "close"  # not 502: nothing was forwarded


async def test_an_empty_api_key_does_not_open_a_public_gateway(chat_model):
    """docs/gateway.md: without keys the gateway refuses to bind anything but loopback; a request without a key is
    a 401. ``--auth.api_keys ''`` (an empty Secret value, a stray quote) must not count as a key."""
    cfg = {"model": {"path": "m"}, "auth": {"api_keys": [""]}, "server": {"host": "0.0.0.0"}}
    try:
        GatewaySettings.model_validate(cfg)
    except ValueError:
        return  # refused at start-up: the promise holds
    _, _, http = _gateway(chat_model, auth={"api_keys": [""]}, server={"host": "0.0.0.0"})
    r = await http.post("/v1/sessions", json={})
    assert r.status_code == 401, r.text


async def test_a_forged_session_id_is_a_404_where_it_lands(chat_model):
    """docs/gateway.md: only ids signed with the shared keys are followed; a forged id is answered where it lands
    (404), for any characters a client puts in the path."""
    app, _, http = _gateway(chat_model, auth={"api_keys": [KEY]}, replica={"public_url": "http://10.0.0.1:8000"})
    headers = {"authorization": f"Bearer {KEY}"}
    for sid in ("abc.def.0123456789abcdef", "abc.%C3%A9.x"):
        r = await http.get(f"/v1/sessions/{sid}", headers=headers)
        assert r.status_code == 404, (sid, r.text)


def test_a_redis_password_in_the_url_query_is_masked():
    """README: --dry-run prints the resolved config with URL passwords masked (redis-py reads ``?password=``
    too; molt/serve.py's preflight prints the same masked URL when Redis does not answer)."""
    out = mask_secrets({"redis": {"url": f"redis://h:6379/0?password={TOKEN}"}})
    assert TOKEN not in json.dumps(out) and MASK in out["redis"]["url"]


# ---------------------------------------------------------------- env worker: the gateway key stays a header


async def test_the_env_workers_gateway_key_reaches_the_gateway_only(tmp_path, caplog):
    """docs/envs.md / docs/deploy.md: the worker authenticates to the gateway with its key (a bearer header) and
    shows it nowhere: not in its answers (an episode the gateway refuses included), /metrics, probes or logs."""
    caplog.set_level(logging.DEBUG)
    agent = tmp_path / "agent.py"
    agent.write_text(
        "from molt.agents import Env, Result, StepEnvRunner\n"
        "class E(Env):\n"
        "    async def step(self, state):\n"
        "        return Result(reward=1.0)\n"
        "class AgentRunner(StepEnvRunner):\n"
        "    def __init__(self):\n"
        "        super().__init__(E)\n"
    )
    fake = FakeGateway(policy=lambda prompt, turn: "yes")
    seen: list[str | None] = []
    refuse = {"on": False}

    async def gateway(scope, receive, send):  # the fake gateway, with the key check of a real one
        if scope["type"] == "http":
            auth = dict(scope["headers"]).get(b"authorization", b"").decode()
            seen.append(auth)
            if refuse["on"] or auth != f"Bearer {KEY}":
                body = json.dumps({"error": {"message": "missing or invalid API key", "code": "invalid_api_key"}})
                headers = [(b"content-type", b"application/json")]
                await send({"type": "http.response.start", "status": 401, "headers": headers})
                await send({"type": "http.response.body", "body": body.encode()})
                return
        await fake.app(scope, receive, send)

    settings = EnvsSettings(
        agent=[f"echo={agent}"], gateway={"url": "http://gw", "api_key": KEY}, envs={"episode_timeout_s": 5.0}
    )
    app = build_envs_app(settings, gateway_transport=httpx.ASGITransport(app=gateway))
    req = {"agent": "echo", "prompt": "say yes", "label": "x", "group_id": "g", "sample_index": 0}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://w") as w:
        ok = await w.post("/v1/episodes:run", json=req)
        assert ok.status_code == 200 and ok.json()["status"] == "ok", ok.text
        refuse["on"] = True
        refused = await w.post("/v1/episodes:run", json=req)
        answers = [ok, refused, *[await w.get(p) for p in (*PROBES, "/nope")]]
    assert refused.json()["status"] == "failed" and "401" in refused.json()["error"]
    assert seen and all(a == f"Bearer {KEY}" for a in seen)
    for a in answers:
        assert KEY not in a.text and KEY not in json.dumps(dict(a.headers))
    assert KEY not in caplog.text


# ---------------------------------------------------------------- slow clients: every request head is timed


def _app_factory():
    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        if scope["path"] == "/slow":
            await asyncio.sleep(0.6)  # longer than the header timeout: a running request is not a slow head
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    return app


@pytest.fixture
def guarded_port():
    """A real uvicorn server with the services' config (molt.serve.uvicorn_config) on loopback, in a thread, with
    a 0.3 s header timeout; its port."""
    cfg = uvicorn_config(_app_factory(), ServerConfig(host="127.0.0.1", header_timeout_s=0.3))
    srv = uvicorn.Server(cfg)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    thread = threading.Thread(target=lambda: asyncio.run(srv.serve(sockets=[sock])), daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not srv.started and time.monotonic() < deadline:
        time.sleep(0.02)
    yield sock.getsockname()[1]
    srv.should_exit = True
    thread.join(10)
    sock.close()


def _read_responses(s: socket.socket, n: int, timeout_s: float = 5.0) -> bytes:
    s.settimeout(timeout_s)
    got = b""
    while got.count(b"HTTP/1.1 200") < n or not got.endswith(b"ok"):
        chunk = s.recv(4096)
        if not chunk:
            raise ConnectionError(f"closed after {got!r}")
        got += chunk
    return got


def test_kept_alive_connections_that_send_their_heads_at_once_are_never_cut(guarded_port):
    """The guard only times heads: an idle gap between requests (uvicorn's keep-alive), a handler slower than
    the header timeout and a pipelined head split around a response all go through."""
    with socket.create_connection(("127.0.0.1", guarded_port)) as s:
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        _read_responses(s, 1)
        time.sleep(0.6)  # idle past the header timeout: not a slow head
        s.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
        _read_responses(s, 1)
        # the next head's blank line is split: half pipelined behind a slow request, the rest after its answer
        s.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\nGET /slow HTTP/1.1\r\nHost: x\r\n")
        _read_responses(s, 1)
        s.sendall(b"\r\n")
        _read_responses(s, 1)
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        _read_responses(s, 1)
