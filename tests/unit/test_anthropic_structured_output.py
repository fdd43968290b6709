"""Anthropic structured outputs: ``output_config.format`` (and the beta's top-level ``output_format``) become the
pod's ``structured_outputs`` exactly as the OpenAI wire's ``response_format`` json_schema does, tools included
(under tool choice "auto" the reply is the JSON or calls, the constraint the OpenAI wire builds); the other
``output_config`` fields are honoured where the template can (``effort``) and refused by name otherwise
(in-process app, fake pods, the real anthropic SDK)."""

from __future__ import annotations

import json
import shutil

import anthropic
import pydantic
import pytest

from services.gateway.chat import ChatModel
from tests.gateway_testlib import scripted_gateway

PODS = ["http://pod-a:1"]
HI = [{"role": "user", "content": "Verdict?"}]
SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}, "score": {"type": "integer"}},
    "required": ["answer", "score"],
    "additionalProperties": False,
}
REPLY = '{"answer": "yes", "score": 3}'
FORMAT = {"type": "json_schema", "schema": SCHEMA}
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


class Verdict(pydantic.BaseModel):
    answer: str
    score: int


@pytest.fixture(scope="module")
def model(tiny_qwen3) -> ChatModel:
    return ChatModel(tiny_qwen3)


@pytest.fixture
def gw(model):
    _, pods, http = scripted_gateway(model, lambda prompt, sp: model.encode(REPLY + "<|im_end|>"), PODS)
    an = anthropic.AsyncAnthropic(base_url="http://gw", api_key="EMPTY", http_client=http.anthropic)
    return pods.pods[PODS[0]], http, an


async def test_output_config_format_becomes_the_pods_json_schema(gw):
    pod, _, an = gw
    m = await an.messages.create(model="policy", max_tokens=64, messages=HI, output_config={"format": FORMAT})
    assert json.loads(m.content[0].text) == {"answer": "yes", "score": 3} and m.stop_reason == "end_turn"
    assert pod.calls[-1][1]["structured_outputs"] == {"json": SCHEMA}


async def test_the_sdks_parse_sends_its_models_schema_and_reads_the_reply(gw):
    pod, _, an = gw
    m = await an.messages.parse(model="policy", max_tokens=64, messages=HI, output_format=Verdict)
    assert m.parsed_output == Verdict(answer="yes", score=3)
    schema = pod.calls[-1][1]["structured_outputs"]["json"]
    assert schema["type"] == "object" and set(schema["properties"]) == {"answer", "score"}


async def test_the_betas_top_level_output_format_is_the_same_setting(gw):
    pod, _, an = gw
    await an.beta.messages.create(
        model="policy",
        max_tokens=64,
        messages=HI,
        betas=["structured-outputs-2025-11-13"],
        extra_body={"output_format": FORMAT},
    )
    assert pod.calls[-1][1]["structured_outputs"] == {"json": SCHEMA}


async def test_a_streamed_structured_reply_is_the_json(gw):
    pod, _, an = gw
    async with an.messages.stream(model="policy", max_tokens=64, messages=HI, output_config={"format": FORMAT}) as st:
        assert "".join([t async for t in st.text_stream]) == REPLY
    assert pod.calls[-1][1]["structured_outputs"] == {"json": SCHEMA}


@pytest.mark.parametrize("parallel", [True, False])
async def test_with_tools_under_auto_the_reply_is_the_json_or_calls_as_on_the_openai_wire(gw, parallel):
    """The same request on both wires gets the same constraint (tool_choice.json_or_calls): the JSON, or calls
    in the template's format, one call where parallel calls are off."""
    pod, http, an = gw
    await an.messages.create(
        model="policy",
        max_tokens=64,
        messages=HI,
        tools=[{"name": "get_weather", "input_schema": CITY}],
        tool_choice={"type": "auto", "disable_parallel_tool_use": not parallel},
        output_config={"format": FORMAT},
    )
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "", "parameters": CITY}}]
    body = {
        "model": "policy",
        "messages": HI,
        "max_tokens": 64,
        "tools": tools,
        "parallel_tool_calls": parallel,
        "response_format": {"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA}},
    }
    assert (await http.post("/v1/chat/completions", json=body)).status_code == 200
    (anthropic_prompt, anthropic_sp), (openai_prompt, openai_sp) = pod.calls
    either = anthropic_sp["structured_outputs"]["structural_tag"]["format"]
    assert either["type"] == "or" and either["elements"][0] == {"type": "json_schema", "json_schema": SCHEMA}
    assert anthropic_sp["structured_outputs"] == openai_sp["structured_outputs"]
    assert anthropic_prompt == openai_prompt


async def test_a_strict_tool_is_held_to_its_schema_under_auto(gw):
    """Anthropic's strict tool use: the tool's arguments match its schema when it is called (the mark stays out
    of the rendered tool, as the template never sees it)."""
    pod, _, an = gw
    await an.messages.create(
        model="policy",
        max_tokens=64,
        messages=HI,
        tools=[{"name": "get_weather", "input_schema": CITY, "strict": True}],
    )
    calls = pod.calls[-1][1]["structured_outputs"]["structural_tag"]["format"]
    assert calls["type"] == "triggered_tags" and calls["tags"][0]["content"]["json_schema"] == CITY
    await an.messages.create(
        model="policy", max_tokens=64, messages=HI, tools=[{"name": "get_weather", "input_schema": CITY}]
    )
    assert "structured_outputs" not in pod.calls[-1][1]


async def test_a_forced_tool_beside_a_format_constrains_this_reply_to_the_call(gw):
    """As Anthropic takes the pair: a forced tool's reply is the call, so the pod gets the call's constraint; the
    format is for a later turn's text reply."""
    pod, _, an = gw
    tools = [{"name": "get_weather", "input_schema": CITY}]
    for choice in ({"type": "any"}, {"type": "tool", "name": "get_weather"}):
        await an.messages.create(
            model="policy",
            max_tokens=64,
            messages=HI,
            tools=tools,
            tool_choice=choice,
            output_config={"format": FORMAT},
        )
        call = pod.calls[-1][1]["structured_outputs"]["structural_tag"]["format"]
        assert call["type"] == "tag" and "get_weather" in call["begin"], call
        assert call["content"] == {"type": "json_schema", "json_schema": CITY}


async def _error(http, body: dict, path: str = "/v1/messages") -> str:
    r = await http.post(path, json={"model": "policy", "max_tokens": 64, "messages": HI, **body})
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error", err
    return err["error"]["message"]


@pytest.mark.parametrize(
    "body, needle",
    [
        ({"output_config": {"format": {"type": "json_object"}}}, "'output_config.format' must be"),
        ({"output_config": {"format": {"type": "json_schema"}}}, "'output_config.format' must be"),
        ({"output_format": {"type": "json_schema", "schema": "x"}}, "'output_format' must be"),
        ({"output_config": "json"}, "'output_config' must be an object"),
        ({"output_config": {"format": FORMAT}, "output_format": FORMAT}, "one setting"),
        ({"output_config": {"task_budget": {"type": "tokens", "total": 9}}}, "'output_config.task_budget'"),
        ({"output_config": {"verbosity": "low"}}, "'output_config.verbosity'"),
        ({"output_config": {"effort": "extreme"}}, "'output_config.effort' must be one of"),
        ({"output_config": {"effort": "low"}}, "reads no reasoning_effort"),
        (
            {"output_config": {"format": FORMAT}, "messages": [*HI, {"role": "assistant", "content": "{"}]},
            "a structured 'output_config.format' cannot continue",
        ),
        (
            {"output_format": FORMAT, "messages": [*HI, {"role": "assistant", "content": "{"}]},
            "a structured 'output_format' cannot continue",
        ),
    ],
)
async def test_what_cannot_be_honoured_is_an_invalid_request_error_naming_it(gw, body, needle):
    _, http, _ = gw
    assert needle in await _error(http, body)


async def test_effort_high_is_the_default_and_count_tokens_takes_output_config(gw):
    pod, http, an = gw
    await an.messages.create(model="policy", max_tokens=64, messages=HI, output_config={"effort": "high"})
    await an.messages.create(model="policy", max_tokens=64, messages=HI)
    (with_effort, sp1), (without, sp2) = pod.calls
    assert with_effort == without and sp1 == sp2
    n = await an.messages.count_tokens(model="policy", messages=HI, output_config={"format": FORMAT, "effort": "high"})
    assert n.input_tokens == len(without)


async def test_effort_reaches_a_template_that_reads_reasoning_effort(tiny_qwen3, tmp_path):
    path = tmp_path / "model"
    shutil.copytree(tiny_qwen3, path)
    tpl = (path / "chat_template.jinja").read_text()
    (path / "chat_template.jinja").write_text(
        "{%- if reasoning_effort is defined -%}{{ 'Effort: ' + reasoning_effort + '\n' }}{%- endif -%}" + tpl
    )
    m = ChatModel(path)
    _, pods, http = scripted_gateway(m, lambda prompt, sp: m.encode(REPLY + "<|im_end|>"), PODS)
    body = {"model": "policy", "max_tokens": 8, "messages": HI, "output_config": {"effort": "low"}}
    r = await http.post("/v1/messages", json=body)
    assert r.status_code == 200, r.text
    [(prompt, _)] = pods.pods[PODS[0]].calls
    assert m.decode(prompt, skip_special=False).startswith("Effort: low\n")
