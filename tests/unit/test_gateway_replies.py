"""Which replies carry structured tool calls (in-process app, fake pods, the real OpenAI SDK): as vLLM's server,
only a request that offers tools, on a session or without one; a "raw" session (ChatAgentRunner's, for Molt's
ChatAgents) never, its text as generated, as Molt's chat server answers."""

from __future__ import annotations

import openai
import pytest

from services.gateway.chat import ChatModel
from tests.gateway_testlib import scripted_gateway

PODS = ["http://pod-a:1"]
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "paris"}}</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def model(tiny_qwen3) -> ChatModel:
    return ChatModel(tiny_qwen3)


@pytest.fixture
def http(model):
    _app, _pods, client = scripted_gateway(model, lambda prompt, sp: model.encode(CALL + "<|im_end|>"), PODS)
    return client


@pytest.mark.parametrize(
    "replies,tools,structured",
    [
        ("parsed", TOOLS, True),
        ("parsed", None, False),
        ("raw", TOOLS, False),
        (None, TOOLS, True),  # session-less
        (None, None, False),
    ],
)
async def test_a_call_is_structured_only_when_tools_are_offered_outside_raw_sessions(http, replies, tools, structured):
    if replies is None:
        base = "http://gw/v1"
    else:
        base = (await http.post("/v1/sessions", json={"replies": replies})).json()["openai_base_url"]
    client = openai.AsyncOpenAI(base_url=base, api_key="EMPTY", http_client=http)
    kw = {"tools": tools} if tools else {}
    choice = (await client.chat.completions.create(model="policy", messages=ASK, **kw)).choices[0]
    if structured:
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls[0].function.name == "get_weather"
        assert not choice.message.content
    else:
        assert choice.finish_reason == "stop" and choice.message.content == CALL and not choice.message.tool_calls


def test_an_anthropic_system_given_as_text_blocks_reaches_the_template_as_one_text():
    # the SDKs' list form, prompt-caching marks included (Molt's chat server renders it so too)
    from services.gateway.anthropic_wire import parse_messages

    cached = {"type": "text", "text": "Use tools.", "cache_control": {"type": "ephemeral"}}
    system = [{"type": "text", "text": "Be brief. "}, cached]
    body = {"model": "policy", "max_tokens": 8, "system": system, "messages": ASK}
    assert parse_messages(body).messages[0] == {"role": "system", "content": "Be brief. Use tools."}
