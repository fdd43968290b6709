"""A parameter sent as JSON null is absent, on every wire, as OpenAI's and Anthropic's APIs read it: SDK models
and frameworks that serialise every field send nulls for what they do not set (the openai and anthropic SDKs
themselves for their Optional arguments). A null is never refused, not even for a parameter the gateway refuses
or does not know, and a null inside an object is its field left out; the same parameter with a value is still
refused in the wire's error shape (in-process app, fake pods)."""

from __future__ import annotations

import anthropic
import openai
import pytest

from services.gateway import sampling, surface
from services.gateway.chat import ChatModel
from services.gateway.errors import GatewayError
from tests.gateway_testlib import scripted_gateway

PODS = ["http://pod-a:1"]
HI = [{"role": "user", "content": "hi"}]
BASE = {
    "/v1/chat/completions": {"model": "policy", "messages": HI, "max_tokens": 4},
    "/v1/completions": {"model": "policy", "prompt": "hi", "max_tokens": 4},
    "/v1/messages": {"model": "policy", "max_tokens": 4, "messages": HI},
    "/v1/responses": {"model": "policy", "input": "hi", "max_output_tokens": 4},
}
NAMES = dict(zip(BASE, ("chat", "completions", "messages", "responses")))
WIRES = {"/v1/chat/completions": "chat", "/v1/completions": "completions", "/v1/messages": "messages"}
# Each wire's refused parameters, one it does not know, and those honoured for some values only.
NULLS = [
    *[(p, k) for p, w in WIRES.items() for k, v in surface.TABLES[w].items() if v == surface.REFUSED],
    *[(p, "frobnicate") for p in BASE],
    ("/v1/completions", "best_of"),
    *[("/v1/responses", k) for k in ("previous_response_id", "prompt", "top_logprobs", "include", "conversation")],
]


@pytest.fixture(scope="module")
def model(tiny_qwen3) -> ChatModel:
    return ChatModel(tiny_qwen3)


@pytest.fixture
def gw(model):
    _, pods, http = scripted_gateway(model, lambda prompt, sp: model.encode("ok<|im_end|>"), PODS)
    return pods.pods[PODS[0]], http


@pytest.mark.parametrize("path, key", NULLS, ids=[f"{NAMES[p]}:{k}" for p, k in NULLS])
async def test_a_null_parameter_is_absent_even_where_a_value_is_refused(gw, path, key):
    pod, http = gw
    r = await http.post(path, json={**BASE[path], key: None})
    assert r.status_code == 200, r.text
    [(prompt, sp)] = pod.calls
    pod.calls.clear()
    r = await http.post(path, json=BASE[path])
    assert r.status_code == 200, r.text
    assert pod.calls == [(prompt, sp)]  # what reached the pod is what leaving it out sends


@pytest.mark.parametrize(
    "path, key, value",
    [
        ("/v1/chat/completions", "audio", {"voice": "x", "format": "wav"}),
        ("/v1/chat/completions", "frobnicate", 1),
        ("/v1/completions", "suffix", "end"),
        ("/v1/messages", "container", "c"),
        ("/v1/messages", "frobnicate", 1),
        ("/v1/responses", "previous_response_id", "resp_1"),
        ("/v1/responses", "reasoning", {"summary": "auto"}),
    ],
)
async def test_the_same_parameter_with_a_value_is_still_refused_in_the_wires_shape(gw, path, key, value):
    _, http = gw
    r = await http.post(path, json={**BASE[path], key: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    if path == "/v1/messages":
        assert r.json()["type"] == "error" and err["type"] == "invalid_request_error" and key in err["message"]
    else:
        assert err["type"] == "invalid_request_error" and err["param"].startswith(key)


FN = {"name": "f", "parameters": {"type": "object"}}
TOOL = {"name": "f", "input_schema": {"type": "object"}}


def _anthropic_turns(use: dict) -> list[dict]:
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "x"}]}
    return [*HI, {"role": "assistant", "content": [use]}, {"role": "user", "content": [result]}]


def _parts(kind: str) -> list[dict]:
    return [{"type": kind, "text": "hi"}, {"type": kind, "text": None}]


# (path, a body with nulls inside an object, the same body with those fields left out; None: the base body)
INSIDE = {
    "chat:json_schema.schema": (
        "/v1/chat/completions",
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": None, "strict": None}}},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
    ),
    "chat:text_part.text": ("/v1/chat/completions", {"messages": [{"role": "user", "content": _parts("text")}]}, None),
    "chat:tool.type": (
        "/v1/chat/completions",
        {"tools": [{"type": None, "function": FN}]},
        {"tools": [{"function": FN}]},
    ),
    "responses:item.type": ("/v1/responses", {"input": [{"type": None, "role": "user", "content": "hi"}]}, None),
    "responses:reasoning_and_text_fields": (
        "/v1/responses",
        {
            "reasoning": {"effort": None, "summary": None, "generate_summary": None, "frobnicate": None},
            "text": {"format": None, "verbosity": None},
        },
        None,
    ),
    "messages:text_block.text": ("/v1/messages", {"messages": [{"role": "user", "content": _parts("text")}]}, None),
    "messages:tool_use.input": (
        "/v1/messages",
        {"messages": _anthropic_turns({"type": "tool_use", "id": "toolu_1", "name": "f", "input": None})},
        {"messages": _anthropic_turns({"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}})},
    ),
    "messages:tool.description": (
        "/v1/messages",
        {"tools": [{**TOOL, "description": None, "type": None, "cache_control": None}]},
        {"tools": [TOOL]},
    ),
    "messages:tool_choice_thinking_output_config": (
        "/v1/messages",
        {
            "tool_choice": {"type": "auto", "disable_parallel_tool_use": None},
            "thinking": None,
            "output_config": {"effort": None, "format": None, "task_budget": None},
        },
        None,
    ),
}


@pytest.mark.parametrize("case", list(INSIDE))
async def test_a_null_field_inside_an_object_is_that_field_left_out(gw, model, case):
    """What reaches the pod (prompt and sampling params) is what the request without the field sends: a null
    is never refused, nor rendered (a text part whose text is null added the word "None")."""
    pod, http = gw
    path, nulls, absent = INSIDE[case]
    for body in (nulls, absent or {}):
        r = await http.post(path, json={**BASE[path], **body})
        assert r.status_code == 200, r.text
    (with_nulls, sp_nulls), (without, sp) = pod.calls
    assert with_nulls == without and sp_nulls == sp
    assert "None" not in model.decode(with_nulls, skip_special=False)


async def test_count_tokens_takes_a_null_max_tokens(gw):
    _, http = gw
    r = await http.post("/v1/messages/count_tokens", json={"model": "policy", "messages": HI, "max_tokens": None})
    assert r.status_code == 200 and r.json()["input_tokens"] > 0, r.text


async def test_the_sdks_optional_arguments_sent_as_null_are_taken(gw):
    """Both SDKs send an Optional argument given as None as a null: the call goes through as without it."""
    pod, http = gw
    client = openai.AsyncOpenAI(base_url="http://gw/v1", api_key="EMPTY", http_client=http)
    r = await client.chat.completions.create(
        model="policy",
        messages=HI,
        max_tokens=4,
        audio=None,
        modalities=None,
        prediction=None,
        verbosity=None,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": None}},
    )
    assert r.choices[0].message.content == "ok"
    c = await client.completions.create(model="policy", prompt="hi", max_tokens=4, suffix=None, best_of=None)
    assert c.choices[0].text == "ok"
    an = anthropic.AsyncAnthropic(base_url="http://gw", api_key="EMPTY", http_client=http.anthropic)
    m = await an.messages.create(
        model="policy",
        max_tokens=4,
        messages=HI,
        container=None,
        cache_control=None,
        speed=None,
        inference_geo=None,
        output_config={"effort": None, "format": None},
    )
    assert m.content[0].text == "ok"


def test_a_null_session_sampling_param_is_the_pods_default():
    # n null was a 400 ("must be 1"), and a null unknown to sessions (logprobs) refused as unknown
    sp = {"n": None, "temperature": None, "logprobs": None, "stop": None, "max_tokens": 8}
    assert sampling.session_params(sp, 100) == {"max_tokens": 8}
    assert sampling.session_params({"max_tokens": 0, "seed": None}, 100, turn=True) == {"max_tokens": 0}
    with pytest.raises(GatewayError) as err:
        sampling.session_params({"logprobs": 1}, 100)
    assert err.value.param == "sampling_params.logprobs"


async def test_a_null_inside_a_session_open_is_absent(gw):
    _, http = gw
    r = await http.post("/v1/sessions", json={"sampling_params": {"n": None, "temperature": None}})
    assert r.status_code == 201, r.text  # n null was a 400 ("must be 1 on a session")
    fields = {"sample_index": None, "context_full": None, "replies": None, "max_length": None, "lease_s": None}
    r = await http.post("/v1/sessions", json=fields)
    assert r.status_code == 201, r.text  # sample_index, context_full and replies null were 400s
    r = await http.post("/v1/sessions", json={"replies": ""})
    assert r.status_code == 400 and "replies" in r.text
