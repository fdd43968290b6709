"""Every gateway response carries `x-molt-policy-version` (docs/contracts.md), errors included: a client that
logs the policy version of what it got must find it on a 4xx/5xx answer as on a turn."""

from __future__ import annotations

import pytest

from services.gateway.chat import ChatModel
from tests.gateway_testlib import scripted_gateway

PODS = ["http://pod-a:1", "http://pod-b:2"]
VERSION = 3  # not the start value 0: the header must be the policy version the pods serve, not a constant
CHAT = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def model(tiny_qwen3) -> ChatModel:
    return ChatModel(tiny_qwen3)


async def _gateway(model, **sections):
    """A gateway whose pods serve policy VERSION, after one turn (so it knows it), and one open session id."""
    app, pods, http = scripted_gateway(model, lambda prompt, sp: model.encode("Hi.<|im_end|>"), PODS, **sections)
    for pod in pods.pods.values():
        pod.version = VERSION
    headers = {"authorization": "Bearer k1"} if sections.get("auth") else {}
    http.headers.update(headers)
    r = await http.post("/v1/sessions", json={})
    assert r.status_code == 201, r.text
    sid = r.json()["session_id"]
    r = await http.post(f"/s/{sid}/v1/chat/completions", json=CHAT)
    assert r.status_code == 200 and r.headers["x-molt-policy-version"] == str(VERSION)
    return app, pods, http, sid


def _stamped(r, status: int) -> None:
    assert r.status_code == status, r.text
    assert r.headers.get("x-molt-policy-version") == str(VERSION), (r.request.method, r.request.url, r.headers)


async def test_every_response_carries_the_policy_version_errors_included(model):
    app, pods, http, sid = await _gateway(model, session={"max_body_bytes": 4096})
    _stamped(await http.get("/healthz"), 200)
    _stamped(await http.get("/v1/models"), 200)
    _stamped(await http.get(f"/v1/sessions/{sid}"), 200)
    _stamped(await http.post("/v1/sessions", content=b"{not json", headers={"content-type": "application/json"}), 400)
    _stamped(await http.post("/v1/sessions", json={"sample_index": "first"}), 400)  # a field of the wrong type
    _stamped(await http.post("/s/nope/v1/chat/completions", json=CHAT), 404)  # unknown session
    _stamped(await http.get("/v1/sessions/nope"), 404)
    _stamped(await http.get("/no/such/route"), 404)
    _stamped(await http.put("/v1/sessions"), 405)
    _stamped(await http.post("/v1/sessions", content=b"x" * 8192, headers={"content-type": "application/json"}), 413)
    async with http.stream("POST", f"/s/{sid}/v1/chat/completions", json={**CHAT, "stream": True}) as r:
        _stamped(r, 200)
        await r.aread()


async def test_no_pod_and_internal_errors_carry_the_policy_version(model):
    app, pods, http, sid = await _gateway(model)
    for pod in pods.pods.values():
        pod.down = True
    other = {"messages": [{"role": "user", "content": "a new turn"}]}  # a repeat of CHAT is answered from cache
    _stamped(await http.post(f"/s/{sid}/v1/chat/completions", json=other), 503)

    async def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    app.gateway.session = broken  # any handler's unexpected exception becomes a 500
    _stamped(await http.get(f"/v1/sessions/{sid}"), 500)


async def test_auth_refusals_carry_the_policy_version(model):
    app, pods, http, sid = await _gateway(model, auth={"api_keys": ["k1"], "max_open_sessions_per_key": 1})
    _stamped(await http.post("/v1/sessions", json={}, headers={"authorization": "Bearer bad"}), 401)
    _stamped(await http.post("/v1/sessions", json={}), 429)  # k1's one session is open
