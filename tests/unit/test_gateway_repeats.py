"""A request repeated or sent back: identical retries answered from the cache (and when a repeat is a new
sample), and Anthropic tool inputs that round-trip to what the model wrote. In-process, real SDKs, fake pods."""

from __future__ import annotations

import anthropic
import openai
import pytest

from services.gateway.chat import ChatModel
from tests.gateway_testlib import FakePods, queued_gateway

PODS = ["http://pod-a:1"]
CITY = {"type": "object", "properties": {"city": {"type": "string"}}}


@pytest.fixture(scope="module")
def model(tiny_qwen3) -> ChatModel:
    return ChatModel(tiny_qwen3)


@pytest.fixture
def env(model):
    app, pods, queue, http = queued_gateway(model, PODS)
    return app, pods, queue, http


async def _open(http) -> dict:
    r = await http.post("/v1/sessions", json={})
    assert r.status_code == 201, r.text
    return r.json()


def _calls(pods: FakePods) -> list:
    return [c for p in pods.pods.values() for c in p.calls]


async def test_identical_retry_returns_cached_answer(env):
    app, pods, replies, http = env
    s = await _open(http)
    client = openai.AsyncOpenAI(base_url=s["openai_base_url"], api_key="EMPTY", http_client=http)
    msgs = [{"role": "user", "content": "hi"}]
    replies[:] = ["First.<|im_end|>", "Second.<|im_end|>"]
    a = await client.chat.completions.create(model="policy", messages=msgs)
    url, body = f"/s/{s['session_id']}/v1/chat/completions", {"model": "policy", "messages": msgs}
    # an SDK's own retry (it numbers its attempts) and a client that does not number them: the last answer again
    for headers in ({"x-stainless-retry-count": "1"}, {}):
        b = (await http.post(url, json=body, headers=headers)).json()
        assert b["choices"][0]["message"]["content"] == a.choices[0].message.content == "First."
    assert len(_calls(pods)) == 1
    summary = (await http.get(f"/v1/sessions/{s['session_id']}")).json()
    assert summary["turns"] == 1 and summary["segments"] == 1
    # the same request as a first attempt is a new sample (dspy resamples so): generated, as a new segment
    again = await client.chat.completions.create(model="policy", messages=msgs)
    assert again.choices[0].message.content == "Second." and len(_calls(pods)) == 2
    # the same messages with other parameters are a new request even on a retry: generated anew
    replies[:] = ['{"a": 1}<|im_end|>']
    retry = {"x-stainless-retry-count": "1"}
    body = {**body, "response_format": {"type": "json_object"}, "max_tokens": 40}
    c = (await http.post(url, json=body, headers=retry)).json()
    assert c["choices"][0]["message"]["content"] == '{"a": 1}' and len(_calls(pods)) == 3
    assert _calls(pods)[2][1].get("structured_outputs") == {"json_object": True}
    summary = (await http.get(f"/v1/sessions/{s['session_id']}")).json()
    assert summary["turns"] == 3 and summary["segments"] == 3  # each re-asked turn is a rewritten history


@pytest.mark.parametrize(("written", "shown"), [('"plain"', {"_raw": "plain"}), ("[1, 2]", {"_value": [1, 2]})])
async def test_anthropic_tool_input_that_is_not_an_object_comes_back_as_written(env, written, shown):
    """Anthropic's tool input is an object: arguments the model wrote as a string or a list are wrapped, and
    unwrapped when the client echoes the call, so the next turn extends the segment."""
    app, pods, replies, http = env
    s = await _open(http)
    an = anthropic.AsyncAnthropic(base_url=s["anthropic_base_url"], api_key="EMPTY", http_client=http.anthropic)
    tools = [{"name": "get_weather", "input_schema": CITY}]
    replies[:] = [f'<tool_call>{{"name": "get_weather", "arguments": {written}}}</tool_call><|im_end|>']
    msgs = [{"role": "user", "content": "Weather?"}]
    m1 = await an.messages.create(model="policy", max_tokens=30, messages=msgs, tools=tools)
    [use] = [b for b in m1.content if b.type == "tool_use"]
    assert use.input == shown
    result = {"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}
    msgs += [
        {"role": "assistant", "content": [b.model_dump() for b in m1.content]},
        {"role": "user", "content": [result]},
    ]
    await an.messages.create(model="policy", max_tokens=10, messages=msgs, tools=tools)
    summary = (await http.get(f"/v1/sessions/{s['session_id']}")).json()
    assert summary["turns"] == 2 and summary["segments"] == 1
