"""A turn past the session's context, as agent frameworks see it (gateway app in-process, fake pod): the 400
``context_length_exceeded`` is worded as each wire's own server words it, because that wording is how clients
tell an overflow (which they answer by compacting the history) from any other 400. LiteLLM raises its
ContextWindowExceededError on "This model's maximum context length is" (OpenAI, vLLM) and "prompt is too long"
(Anthropic), CrewAI matches "maximum context length", pydantic-ai's Anthropic model and Claude Code match
"prompt is too long": with the gateway's own wording none of them saw an overflow, only a bad request."""

from __future__ import annotations

import openai
import pytest

from tests.gateway_testlib import queued_gateway

PODS = ["http://pod-a:1"]
LONG = "word " * 400


@pytest.fixture
def gw(chat_model):
    return queued_gateway(chat_model, PODS)


async def _session(http, max_length: int = 64) -> dict:
    r = await http.post("/v1/sessions", json={"max_length": max_length})
    assert r.status_code == 201, r.text
    return r.json()


async def test_openai_wires_word_an_overflow_as_openai_and_vllm_do(gw):
    _app, _pods, _queue, http = gw
    s = await _session(http)
    sid = s["session_id"]
    for path, body in (
        ("/v1/chat/completions", {"model": "policy", "messages": [{"role": "user", "content": LONG}]}),
        ("/v1/responses", {"model": "policy", "input": LONG}),
    ):
        r = await http.post(f"/s/{sid}{path}", json=body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert (err["code"], err["param"], err["type"]) == (
            "context_length_exceeded",
            "messages",
            "invalid_request_error",
        )
        # LiteLLM's and CrewAI's overflow check (lower-cased substring), and the numbers a client reads back.
        assert "this model's maximum context length is 64 tokens" in err["message"].lower(), err["message"]
        assert "this turn needs" in err["message"] and "max_length" in err["message"]
    # Through the SDK: the message the exception carries, which is all LangChain and LiteLLM look at.
    client = openai.AsyncOpenAI(base_url=s["openai_base_url"], api_key="EMPTY", http_client=http, max_retries=0)
    with pytest.raises(openai.BadRequestError) as exc:
        await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": LONG}])
    assert exc.value.code == "context_length_exceeded"
    assert "maximum context length is 64 tokens" in exc.value.message
    # A session-less request past the gateway's limit says so the same way.
    r = await http.post(
        "/v1/chat/completions", json={"model": "policy", "messages": [{"role": "user", "content": LONG * 20}]}
    )
    assert r.status_code == 400 and "This model's maximum context length is" in r.json()["error"]["message"], r.text


async def test_the_anthropic_wire_words_an_overflow_as_anthropic_does(gw):
    _app, _pods, _queue, http = gw
    s = await _session(http)
    r = await http.post(
        f"/s/{s['session_id']}/v1/messages",
        json={"model": "policy", "max_tokens": 16, "messages": [{"role": "user", "content": LONG}]},
    )
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    message = body["error"]["message"]
    assert message.startswith("prompt is too long: "), message
    needed, limit = message.removeprefix("prompt is too long: ").split(" maximum")[0].split(" tokens > ")
    assert int(needed) > int(limit) == 64
    # Streamed: the same 400 as the HTTP status, before any event.
    r = await http.post(
        f"/s/{s['session_id']}/v1/messages",
        json={"model": "policy", "max_tokens": 16, "stream": True, "messages": [{"role": "user", "content": LONG}]},
    )
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("prompt is too long: "), r.text


async def test_pydantic_ai_sees_a_context_window_error_on_both_providers(gw):
    """pydantic-ai (a dev dependency) classifies the overflow itself: on its Anthropic model only by the message."""
    import anthropic
    import httpx2
    from pydantic_ai import Agent
    from pydantic_ai.exceptions import ModelContextWindowExceededError
    from pydantic_ai.models.anthropic import AnthropicModel
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.anthropic import AnthropicProvider
    from pydantic_ai.providers.openai import OpenAIProvider

    app, _pods, _queue, http = gw
    s = await _session(http)
    oa = openai.AsyncOpenAI(base_url=s["openai_base_url"], api_key="EMPTY", http_client=http, max_retries=0)
    an = anthropic.AsyncAnthropic(
        base_url=s["anthropic_base_url"],
        api_key="EMPTY",
        max_retries=0,
        http_client=httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://gw"),
    )
    for model in (
        OpenAIChatModel("policy", provider=OpenAIProvider(openai_client=oa)),
        AnthropicModel("policy", provider=AnthropicProvider(anthropic_client=an)),
    ):
        with pytest.raises(ModelContextWindowExceededError):
            await Agent(model).run(LONG)
