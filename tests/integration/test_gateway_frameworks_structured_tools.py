"""A JSON response format on a request that offers tools, as agent frameworks send it on every turn of a tool loop
with a structured final answer: openai-agents' ``Agent(output_type=..., tools=[...])`` (chat ``response_format`` /
Responses ``text.format`` json_schema), pydantic-ai's ``NativeOutput`` (json_schema) and ``PromptedOutput``
(json_object), LangChain's provider strategy. OpenAI answers such a request with the JSON or with tool calls. The
gateway constrained the pod to the JSON alone (vLLM's answer), so the model could never call a tool: every episode
of such an agent ended at its first turn, silently. Real pod (vLLM, tiny model) and gateway, the openai SDK."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from services.gateway import tool_choice as tc
from services.gateway.chat import ChatModel
from tests.gateway_testlib import pod_and_gateway, queued_gateway

pytestmark = [pytest.mark.vllm]

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": CITY}}
]
ANSWER = {"type": "object", "properties": {"temp_c": {"type": "integer"}}, "required": ["temp_c"]}
FORMATS = {
    "json_schema": {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}},
    "json_object": {"type": "json_object"},
}


@pytest.fixture(scope="module")
def gateway(tiny_qwen3, tmp_path_factory):
    with pod_and_gateway(tiny_qwen3, tmp_path_factory.mktemp("gw"), "memory://", "structured-tools") as (url, _, _):
        yield url


def _replies(url: str, fmt: dict, seeds: range, **extra) -> list:
    out = []
    for seed in seeds:
        s = httpx.post(url + "/v1/sessions", json={}).json()
        client = openai.OpenAI(base_url=s["openai_base_url"], api_key="EMPTY", max_retries=0)
        r = client.chat.completions.create(
            model="policy",
            messages=[{"role": "user", "content": "Weather in Paris? Answer as JSON."}],
            tools=TOOLS,
            response_format=fmt,
            max_tokens=48,
            seed=seed,
            **extra,
        )
        out.append(r.choices[0])
    return out


@pytest.mark.parametrize("kind", list(FORMATS))
def test_the_model_may_call_a_tool_or_answer_the_json(gateway, kind):
    choices = _replies(gateway, FORMATS[kind], range(10))
    called = [c for c in choices if c.message.tool_calls]
    assert called, [c.message.content for c in choices]  # before: never (the pod was held to the JSON)
    for c in choices:
        if c.message.tool_calls:
            assert c.finish_reason == "tool_calls"
            for call in c.message.tool_calls:  # each call is in the template's format, its arguments the schema's
                assert call.function.name == "get_weather"
                assert isinstance(json.loads(call.function.arguments)["city"], str)
        elif c.finish_reason == "stop":  # the answer is the JSON (a reply cut at max_tokens may be unfinished)
            answer = json.loads(c.message.content)
            assert isinstance(answer, dict)
            if kind == "json_schema":
                assert isinstance(answer["temp_c"], int)


async def test_the_responses_wire_sends_the_pod_the_same_choice(tiny_qwen3):
    """openai-agents' default model: ``text.format`` json_schema with the agent's function tools (fake pod)."""
    model = ChatModel(tiny_qwen3)
    _app, pods, queue, http = queued_gateway(model, ["http://pod-a:1"])
    s = (await http.post("/v1/sessions", json={})).json()
    queue.append('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call><|im_end|>')
    r = await http.post(
        f"/s/{s['session_id']}/v1/responses",
        json={
            "model": "policy",
            "input": "Weather in Paris? Answer as JSON.",
            "tools": [{"type": "function", **TOOLS[0]["function"]}],
            "text": {"format": {"type": "json_schema", "name": "answer", "schema": ANSWER, "strict": True}},
        },
    )
    assert r.status_code == 200, r.text
    assert [o["type"] for o in r.json()["output"]] == ["function_call"]
    [(_, sp)] = pods.pods["http://pod-a:1"].calls
    either = sp["structured_outputs"]["structural_tag"]["format"]
    assert either["type"] == "or" and either["elements"][0] == {"type": "json_schema", "json_schema": ANSWER}
    assert either["elements"][1]["type"] == "tags_with_separator"


def test_without_parallel_calls_a_reply_holds_at_most_one_call(gateway):
    choices = _replies(gateway, FORMATS["json_schema"], range(10), parallel_tool_calls=False)
    assert any(c.message.tool_calls for c in choices)
    assert all(len(c.message.tool_calls or []) <= 1 for c in choices)


def test_the_pod_gets_the_json_or_the_templates_calls(tiny_qwen3):
    model, ask = ChatModel(tiny_qwen3), [{"role": "user", "content": "hi"}]

    def spec(structured: dict, choice: tc.ToolChoice) -> dict:
        overrides = tc.apply(model, ask, TOOLS, {"structured_outputs": structured, "tool_choice": choice})
        return overrides["structured_outputs"]["structural_tag"]["format"]

    call = {
        "type": "tag",
        "begin": '<tool_call>{"name": "get_weather", "arguments": ',
        "content": {"type": "json_schema", "json_schema": CITY},
        "end": "}</tool_call>",
    }
    # The tiny template writes parallel calls back to back: no separator.
    calls = {"type": "tags_with_separator", "tags": [call], "separator": "", "at_least_one": True}
    assert spec({"json": ANSWER}, tc.ToolChoice("auto")) == {
        "type": "or",
        "elements": [{"type": "json_schema", "json_schema": ANSWER}, calls],
    }
    assert spec({"json_object": True}, tc.ToolChoice("auto", parallel=False)) == {
        "type": "or",
        "elements": [{"type": "json_schema", "json_schema": {"type": "object"}}, call],
    }
    # a forced call beside a JSON format: this reply is the call (the format is for a later text reply)
    forced = {"structured_outputs": {"json": ANSWER}, "tool_choice": tc.ToolChoice("required")}
    assert tc.apply(model, ask, TOOLS, forced)["structured_outputs"]["structural_tag"]["format"] == call
