"""Tool calls read out of the model's text (services/gateway/chat.py, ``parse_tool_calls``) and assistant
refusals in the OpenAI wire's messages, in-process (fake pods, the real OpenAI SDK)."""

from __future__ import annotations

import json

import openai
import pytest

from services.gateway.chat import ChatModel, canonical_messages, parse_tool_calls
from services.gateway.errors import GatewayError
from tests.gateway_testlib import scripted_gateway

PODS = ["http://pod-a:1"]
TRICKY = {"text": "a</tool_call>b"}
CALL = '<tool_call>\n{"name": "write", "arguments": ' + json.dumps(TRICKY) + "}\n</tool_call>"
TOOLS = [{"type": "function", "function": {"name": "write", "parameters": {"type": "object"}}}]
ASK = [{"role": "user", "content": "Write it."}]


@pytest.fixture(scope="module")
def model(tiny_qwen3) -> ChatModel:
    return ChatModel(tiny_qwen3)


def _calls(text: str) -> tuple[str, list[tuple[str, dict]]]:
    content, calls = parse_tool_calls(text)
    return content, [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_a_closer_inside_a_json_string_does_not_end_the_call():
    assert _calls(CALL) == ("", [("write", TRICKY)])
    opener_inside = '<tool_call>{"name": "write", "arguments": {"text": "<tool_call>"}}</tool_call>'
    two = f"Sure. {CALL} then {opener_inside} done"
    assert _calls(two) == ("Sure.  then  done", [("write", TRICKY), ("write", {"text": "<tool_call>"})])


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>{"name": "write", "arguments": {}} trailing</tool_call>',  # more than the JSON before the closer
        '<tool_call>{"name": "write", "arguments": {"text": "a</tool_call>b"}}',  # no closer after the JSON
        '<tool_call>{"name": "write", "arguments": {"text": "a</tool_call>',  # cut off inside the string
        '<tool_call>{"arguments": {"text": "a</tool_call>b"}}</tool_call>',  # no name
        '<tool_call>["write"]</tool_call>',
    ],
)
def test_a_malformed_block_stays_text(text):
    assert parse_tool_calls(text) == (text, [])


def test_a_malformed_block_ends_at_its_first_closer():
    # the next block is read after it, as before calls were read with a JSON decoder
    text = '<tool_call>junk "</tool_call> <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'
    assert _calls(text) == ('<tool_call>junk "</tool_call>', [("f", {"x": 1})])
    nested = '<tool_call>junk <tool_call>{"name": "f", "arguments": {}}</tool_call> after'
    assert parse_tool_calls(nested) == (nested, [])


@pytest.fixture
def http(model):
    _app, _pods, client = scripted_gateway(model, lambda prompt, sp: model.encode(CALL + "<|im_end|>"), PODS)
    return client


@pytest.mark.parametrize("choice", [{"type": "function", "function": {"name": "write"}}, "required", "auto"], ids=str)
async def test_a_call_whose_argument_holds_the_closer_is_one_call_streamed_or_not(http, choice):
    client = openai.AsyncOpenAI(base_url="http://gw/v1", api_key="EMPTY", http_client=http)
    kw = {"model": "policy", "messages": ASK, "tools": TOOLS, "tool_choice": choice}
    plain = (await client.chat.completions.create(**kw)).choices[0]
    async with client.chat.completions.stream(**kw) as stream:
        streamed = (await stream.get_final_completion()).choices[0]
    for c in (plain, streamed):
        assert c.finish_reason == "tool_calls" and not c.message.content
        [call] = c.message.tool_calls
        assert call.function.name == "write" and json.loads(call.function.arguments) == TRICKY


async def test_streamed_calls_come_one_per_chunk(model):
    """As OpenAI and vLLM stream them: llama-index reads only a chunk's first tool_calls entry."""
    two = CALL + "\n" + CALL.replace("write", "read") + "<|im_end|>"
    _app, _pods, http = scripted_gateway(model, lambda prompt, sp: model.encode(two), PODS)
    body = {"model": "policy", "messages": ASK, "tools": TOOLS, "stream": True}
    r = await http.post("/v1/chat/completions", json=body)
    chunks = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
    deltas = [c["choices"][0]["delta"]["tool_calls"] for c in chunks if c["choices"][0]["delta"].get("tool_calls")]
    assert [[(d["index"], d["function"]["name"]) for d in x] for x in deltas] == [[(0, "write")], [(1, "read")]]


def test_assistant_refusals_render_as_its_text():
    parts = {
        "role": "assistant",
        "content": [{"type": "text", "text": "Well, "}, {"type": "refusal", "refusal": "no"}],
    }
    field = {"role": "assistant", "content": None, "refusal": "no"}
    echoed = {"role": "assistant", "content": "ok", "refusal": None}  # the SDK's message, echoed back
    assert [m["content"] for m in canonical_messages([parts, field, echoed])] == ["Well, no", "no", "ok"]


@pytest.mark.parametrize(
    "msg,field",
    [
        ({"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}, "messages[0].content[0].refusal"),
        ({"role": "tool", "content": [{"type": "refusal", "refusal": "no"}]}, "messages[0].content[0].refusal"),
        ({"role": "user", "content": "hi", "refusal": "no"}, "messages[0].refusal"),
        ({"role": "assistant", "content": [{"type": "refusal"}]}, "messages[0].content[0].refusal"),
        ({"role": "assistant", "content": None, "refusal": 1}, "messages[0].refusal"),
    ],
)
def test_a_refusal_elsewhere_is_a_400_naming_it(msg, field):
    with pytest.raises(GatewayError) as err:
        canonical_messages([msg])
    assert (err.value.status, err.value.param) == (400, field) and field in str(err.value)


async def test_an_assistant_refusal_part_reaches_the_prompt_as_its_text(model):
    app, pods, http = scripted_gateway(model, lambda prompt, sp: model.encode("Fine.<|im_end|>"), PODS)
    client = openai.AsyncOpenAI(base_url="http://gw/v1", api_key="EMPTY", http_client=http)
    history = [*ASK, {"role": "assistant", "content": [{"type": "refusal", "refusal": "I will not."}]}]
    r = await client.chat.completions.create(model="policy", messages=[*history, {"role": "user", "content": "Ok."}])
    assert r.choices[0].message.content == "Fine."
    prompt = model.decode(pods.pods[PODS[0]].calls[-1][0], skip_special=False)
    assert "<|im_start|>assistant\nI will not.<|im_end|>" in prompt
    with pytest.raises(openai.BadRequestError) as err:
        await client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}]
        )
    assert err.value.body["param"] == "messages[0].content[0].refusal"
