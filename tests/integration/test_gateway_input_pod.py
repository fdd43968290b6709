"""A real pod behind a real gateway: bad sampling input on every wire is the client's 400 in the wire's shape,
the pod's own 400s included, and the pod stays healthy in the gateway's pool and keeps generating."""

from __future__ import annotations

import math

import httpx
import pytest
from http_fuzz import assert_anthropic_error, assert_openai_error, encode

from tests.gateway_testlib import pod_and_gateway

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def stack(tiny_qwen3, tmp_path_factory):
    logs = tmp_path_factory.mktemp("gwin")
    with pod_and_gateway(
        tiny_qwen3, logs, "memory://", "gateway-input", max_length=256, pod={"max_model_len": 256}
    ) as (url, pod_url, _):
        with httpx.Client(base_url=url, timeout=60) as client:
            yield client, pod_url


def _pod_healthy(client: httpx.Client, pod_url: str) -> bool:
    line = f'molt_gateway_pod_healthy{{rollout_url="{pod_url}"}} '
    [value] = [ln.split()[-1] for ln in client.get("/metrics").text.splitlines() if ln.startswith(line)]
    return float(value) == 1.0


def _generates(client: httpx.Client) -> None:
    r = client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2, "seed": 1})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    "field,value",
    [("seed", 2**64), ("temperature", math.nan), ("temperature", 1e308), ("presence_penalty", 5), ("top_p", 0)],
)
def test_bad_values_on_every_wire_are_400s_and_the_pod_stays_healthy(stack, field, value):
    client, pod_url = stack
    sid = client.post("/v1/sessions", json={}).json()["session_id"]
    openai_paths = ["/v1/chat/completions", f"/s/{sid}/v1/chat/completions", "/v1/completions"]
    for path in openai_paths:
        body = {"messages": MESSAGES} if "chat" in path else {"prompt": "hi"}
        r = client.post(path, content=encode({**body, "max_tokens": 2, field: value}))
        assert assert_openai_error(r.status_code, r.content, {400})["param"] == field
    if field in ("temperature", "top_p"):
        r = client.post(f"/s/{sid}/v1/messages", content=encode({"messages": MESSAGES, "max_tokens": 2, field: value}))
        assert r.status_code == 400 and assert_anthropic_error(r.status_code, r.content)
    r = client.post(
        f"/v1/sessions/{sid}/generate", content=encode({"append_text": "hi", "sampling_params": {field: value}})
    )
    assert assert_openai_error(r.status_code, r.content, {400})["param"] == f"sampling_params.{field}"
    assert _pod_healthy(client, pod_url)
    _generates(client)


def test_a_request_only_the_pod_can_refuse_is_the_clients_400_and_leaves_the_pod_healthy(stack):
    client, pod_url = stack
    for _ in range(3):  # n over the pod's --rollout.max_n (64): the gateway cannot know it, the pod says 400
        r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "n": 65})
        assert "max_n" in assert_openai_error(r.status_code, r.content, {400})["message"]
    assert _pod_healthy(client, pod_url)
    _generates(client)
