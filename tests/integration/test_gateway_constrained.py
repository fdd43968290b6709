"""Constrained generation through the gateway with the real SDKs, a real pod (vLLM, tiny model) and Redis.

``response_format``, vLLM's ``structured_outputs``, ``tool_choice`` (OpenAI and Anthropic),
``parallel_tool_calls``, ``logit_bias`` and ``top_logprobs`` reach the pod's sampler, from the SDKs and from an
Env's token-level turns. The tiny model is random-init, so the assertions are on the
constraint (the JSON parses and matches its schema, the call is there and names the tool), never on content;
and the captured trajectory holds exactly the tokens the pod sampled under the constraint.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Literal

import anthropic
import httpx
import jsonschema
import numpy as np
import openai
import pydantic
import pytest

from molt.agents import Env, Episode, Result, StepEnvRunner
from molt.agents.gateway import GatewayClient
from services.gateway.chat import ChatModel
from tests.gateway_testlib import pod_and_gateway, read_trajectories

pytestmark = [pytest.mark.vllm, pytest.mark.redis]

ANSWER = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}, "score": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["answer", "score"],
    "additionalProperties": False,
}
CITY = {
    "type": "object",
    "properties": {"city": {"enum": ["paris", "rome"]}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": CITY}},
    {"type": "function", "function": {"name": "get_time", "description": "Time in a city", "parameters": CITY}},
]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
# The random model is fond of whitespace, which JSON allows anywhere between tokens: pushed down, its objects
# close within a few dozen tokens. (Whitespace never decides whether the constraint holds.)
MAX_TOKENS = 160


@pytest.fixture(scope="module")
def stack(tiny_qwen3, redis_url, tmp_path_factory):
    # Engine choices Molt's launch scripts pass (`molt train-rl` routes them to the pods) start and serve as usual;
    # an empty backend is vLLM's own choice.
    engine = ["--vllm.block_size", "32", "--vllm.enable_chunked_prefill", "--vllm.mamba_ssm_cache_dtype", "float32"]
    engine += ["--vllm.attention_backend", "", "--vllm.disable_custom_all_reduce"]
    engine += ["--vllm.compilation_config", '{"backend": "eager", "cudagraph_mode": "NONE"}']
    logs = tmp_path_factory.mktemp("gw")
    with pod_and_gateway(tiny_qwen3, logs, redis_url, "gateway-constrained", pod={"extra": engine}) as started:
        url, pod_url, stream = started
        # vLLM prints the config it was built with: the JSON object reached its CompilationConfig.
        assert "'backend': 'eager'" in (logs / "pod.log").read_text()
        yield {"url": url, "pod": pod_url, "redis": redis_url, "stream": stream, "model": ChatModel(tiny_qwen3)}


def _session(stack) -> dict:
    r = httpx.post(stack["url"] + "/v1/sessions", json={})
    assert r.status_code == 201, r.text
    return r.json()


def _segment(stack, sid: str):
    r = httpx.post(f"{stack['url']}/v1/sessions/{sid}/finish", json={"reward": 1.0})
    assert r.status_code == 200, r.text
    [traj] = [t for t in read_trajectories(stack["redis"], stack["stream"]) if t.trajectory_id == sid]
    [seg] = traj.segments
    return seg


def _whitespace_bias(model: ChatModel) -> dict[str, int]:
    return {str(t): -100 for t in range(len(model.tokenizer)) if model.decode([t], skip_special=False).isspace()}


def test_a_json_schema_reply_matches_its_schema_and_is_captured_as_sampled(stack):
    s = _session(stack)
    client = openai.OpenAI(base_url=s["openai_base_url"], api_key="EMPTY")
    fmt = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": ANSWER, "strict": True}}
    r = client.chat.completions.create(
        model="policy",
        messages=ASK,
        response_format=fmt,
        max_tokens=MAX_TOKENS,
        seed=1,
        logprobs=True,
        logit_bias=_whitespace_bias(stack["model"]),
    )
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    jsonschema.validate(json.loads(r.choices[0].message.content), ANSWER)
    seg = _segment(stack, s["session_id"])
    [(start, end)] = seg.action_spans.tolist()
    assert stack["model"].decode(seg.token_ids[start:end].tolist(), skip_special=True) == r.choices[0].message.content
    pod_lps = np.array([c.logprob for c in r.choices[0].logprobs.content], dtype=np.float32)
    np.testing.assert_array_equal(seg.logprobs, pod_lps)


def test_a_json_object_reply_parses_as_an_object(stack):
    client = openai.OpenAI(base_url=stack["url"] + "/v1", api_key="EMPTY")
    r = client.chat.completions.create(
        model="policy",
        messages=ASK,
        response_format={"type": "json_object"},
        max_tokens=MAX_TOKENS,
        seed=2,
        logit_bias=_whitespace_bias(stack["model"]),
    )
    choice = r.choices[0]
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content), dict)
    else:  # the random model may still be inside the object: what it wrote so far opens one
        assert choice.message.content.startswith("{")


def test_tool_choice_required_yields_a_call_that_matches_its_tool(stack):
    s = _session(stack)
    client = openai.OpenAI(base_url=s["openai_base_url"], api_key="EMPTY")
    r = client.chat.completions.create(
        model="policy", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=MAX_TOKENS, seed=3
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    [call] = choice.message.tool_calls
    assert call.function.name in ("get_weather", "get_time")
    jsonschema.validate(json.loads(call.function.arguments), CITY)
    # The next turn sends the call back: the template renders it as the tokens sampled, one segment.
    history = [*ASK, choice.message.model_dump(exclude_none=True)]
    history.append({"role": "tool", "tool_call_id": call.id, "content": "SUNNY"})
    client.chat.completions.create(model="policy", messages=history, tools=TOOLS, max_tokens=4, seed=3)
    seg = _segment(stack, s["session_id"])
    assert len(seg.action_spans) == 2


def test_a_named_tool_choice_yields_that_tool(stack):
    client = openai.OpenAI(base_url=stack["url"] + "/v1", api_key="EMPTY")
    for seed in (4, 5):
        r = client.chat.completions.create(
            model="policy",
            messages=ASK,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "get_time"}},
            max_tokens=MAX_TOKENS,
            seed=seed,
        )
        [call] = r.choices[0].message.tool_calls
        assert call.function.name == "get_time"
        jsonschema.validate(json.loads(call.function.arguments), CITY)


def test_tool_choice_none_yields_no_call_and_keeps_the_tools_in_the_prompt(stack):
    s = _session(stack)
    client = openai.OpenAI(base_url=s["openai_base_url"], api_key="EMPTY")
    # Pushing the call opener up makes the unconstrained model open a call at once; "none" must still refuse it.
    opener = stack["model"].encode("<tool_call>")
    bias = {str(t): 30 for t in opener}
    r = client.chat.completions.create(
        model="policy", messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=24, seed=6, logit_bias=bias
    )
    assert not r.choices[0].message.tool_calls and r.choices[0].finish_reason != "tool_calls"
    seg = _segment(stack, s["session_id"])
    [(start, end)] = seg.action_spans.tolist()
    ids = seg.token_ids.tolist()
    assert "<tool_call>" not in stack["model"].decode(ids[start:end], skip_special=False)
    assert "get_weather" in stack["model"].decode(ids[:start], skip_special=False)


def test_no_parallel_tool_calls_yields_at_most_one_call(stack):
    client = openai.OpenAI(base_url=stack["url"] + "/v1", api_key="EMPTY")
    opener = stack["model"].encode("<tool_call>")
    r = client.chat.completions.create(
        model="policy",
        messages=ASK,
        tools=TOOLS,
        parallel_tool_calls=False,
        max_tokens=MAX_TOKENS,
        seed=7,
        logit_bias={str(t): 30 for t in opener},  # open a call at once (the model would rarely on its own)
    )
    assert len(r.choices[0].message.tool_calls or []) == 1


def test_a_strict_tools_calls_match_its_schema_under_auto(stack):
    """Tool choice auto with parallel calls: a tool marked strict (openai-agents marks every function tool so)
    gets its arguments constrained to its schema, as vLLM applies strict; the pod compiles the constraint."""
    client = openai.OpenAI(base_url=stack["url"] + "/v1", api_key="EMPTY")
    opener = stack["model"].encode("<tool_call>")
    strict = [{**t, "function": {**t["function"], "strict": True}} for t in TOOLS]
    r = client.chat.completions.create(
        model="policy",
        messages=ASK,
        tools=strict,
        max_tokens=MAX_TOKENS,
        seed=7,
        logit_bias={**_whitespace_bias(stack["model"]), **{str(t): 30 for t in opener}},  # open a call at once
    )
    calls = r.choices[0].message.tool_calls
    assert calls, r.choices[0].message
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), CITY)


def test_top_logprobs_returns_that_many_alternatives_per_token(stack):
    client = openai.OpenAI(base_url=stack["url"] + "/v1", api_key="EMPTY")
    r = client.chat.completions.create(
        model="policy", messages=ASK, max_tokens=6, seed=8, logprobs=True, top_logprobs=4
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for tok in content:
        alts = [a.logprob for a in tok.top_logprobs]
        assert len(alts) == 4 and alts == sorted(alts, reverse=True)
        assert tok.logprob <= alts[0] + 1e-6  # the sampled token is at best the most likely one


def test_logit_bias_changes_the_output(stack):
    client = openai.OpenAI(base_url=stack["url"] + "/v1", api_key="EMPTY")
    [token] = stack["model"].encode("yes")
    r = client.chat.completions.create(
        model="policy", messages=ASK, max_tokens=5, seed=9, logprobs=True, logit_bias={str(token): 100}
    )
    assert [stack["model"].encode(c.token)[0] for c in r.choices[0].logprobs.content] == [token] * 5


def test_anthropic_tool_choice_any_tool_and_none(stack):
    client = anthropic.Anthropic(base_url=stack["url"], api_key="EMPTY")
    tools = [{"name": t["function"]["name"], "input_schema": CITY} for t in TOOLS]
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    m = client.messages.create(
        model="policy", max_tokens=MAX_TOKENS, messages=ask, tools=tools, tool_choice={"type": "any"}
    )
    [use] = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and use.name in ("get_weather", "get_time")
    jsonschema.validate(use.input, CITY)
    m = client.messages.create(
        model="policy",
        max_tokens=MAX_TOKENS,
        messages=ask,
        tools=tools,
        tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
    )
    assert [b.name for b in m.content if b.type == "tool_use"] == ["get_weather"]
    m = client.messages.create(model="policy", max_tokens=12, messages=ask, tools=tools, tool_choice={"type": "none"})
    assert not [b for b in m.content if b.type == "tool_use"] and m.stop_reason != "tool_use"


class Verdict(pydantic.BaseModel):
    answer: Literal["yes", "no"]
    city: Literal["paris", "rome"]


def test_anthropic_structured_outputs_reply_with_json_that_matches_the_schema(stack):
    """The anthropic SDK's structured outputs, all three ways it sends them: ``messages.parse`` (a pydantic
    model, as ``output_config.format``), ``output_config.format`` as a schema, and the beta's top-level
    ``output_format``; then with tools. The wire takes no seed or logit_bias: the session's seed makes each
    reply repeatable (the random model's whitespace, which the JSON grammar allows, closes within the budget)."""
    r = httpx.post(stack["url"] + "/v1/sessions", json={"sampling_params": {"seed": 12}})
    assert r.status_code == 201, r.text
    client = anthropic.Anthropic(base_url=r.json()["anthropic_base_url"], api_key="EMPTY")
    parsed = client.messages.parse(model="policy", max_tokens=MAX_TOKENS, messages=ASK, output_format=Verdict)
    assert parsed.stop_reason == "end_turn", parsed
    assert isinstance(parsed.parsed_output, Verdict)
    fmt = {"type": "json_schema", "schema": ANSWER}
    replies = [
        client.messages.create(model="policy", max_tokens=MAX_TOKENS, messages=ASK, output_config={"format": fmt}),
        client.beta.messages.create(
            model="policy",
            max_tokens=MAX_TOKENS,
            messages=ASK,
            betas=["structured-outputs-2025-11-13"],
            extra_body={"output_format": fmt},
        ),
    ]
    for m in replies:
        [block] = m.content
        assert m.stop_reason == "end_turn", m
        jsonschema.validate(json.loads(block.text), ANSWER)
    # with tools under tool choice auto: the JSON or a call, each matching its schema
    tools = [{"name": "get_weather", "input_schema": CITY}]
    m = client.messages.create(
        model="policy", max_tokens=MAX_TOKENS, messages=ASK, tools=tools, output_config={"format": fmt}
    )
    uses = [b for b in m.content if b.type == "tool_use"]
    if uses:
        assert m.stop_reason == "tool_use" and all(u.name == "get_weather" for u in uses), m
        for u in uses:
            jsonschema.validate(u.input, CITY)
    else:
        assert m.stop_reason == "end_turn", m
        jsonschema.validate(json.loads(m.content[0].text), ANSWER)


def test_a_schema_the_pod_cannot_compile_is_a_400_that_says_why(stack):
    client = openai.OpenAI(base_url=stack["url"] + "/v1", api_key="EMPTY")
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="policy",
            messages=ASK,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 12}}},
            max_tokens=4,
        )
    assert "grammar" in str(err.value).lower()


def test_completions_logprobs_return_that_many_alternatives_and_the_token(stack):
    client = openai.OpenAI(base_url=stack["url"] + "/v1", api_key="EMPTY")
    r = client.completions.create(model="policy", prompt="Once upon", max_tokens=5, seed=10, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.top_logprobs) == r.usage.completion_tokens
    for tok, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top[tok] == logprob and len(top) in (3, 4)  # the token itself, when it is not among the top 3


def test_the_responses_wire_constrains_as_chat_does(stack):
    client = openai.OpenAI(base_url=stack["url"] + "/v1", api_key="EMPTY")
    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    r = client.responses.create(
        model="policy",
        input="Weather in Paris?",
        tools=tools,
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=MAX_TOKENS,
    )
    [call] = [o for o in r.output if o.type == "function_call"]
    assert call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), CITY)
    r = client.responses.create(
        model="policy",
        input="Verdict?",
        text={"format": {"type": "json_schema", "name": "verdict", "schema": ANSWER, "strict": True}},
        max_output_tokens=MAX_TOKENS,
    )
    if r.status == "completed":
        jsonschema.validate(json.loads(r.output_text), ANSWER)
    else:
        assert r.output_text.startswith("{")


def test_a_streamed_forced_call_arrives_as_a_tool_call(stack):
    s = _session(stack)
    client = openai.OpenAI(base_url=s["openai_base_url"], api_key="EMPTY")
    stream = client.chat.completions.create(
        model="policy",
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=MAX_TOKENS,
        seed=11,
        stream=True,
    )
    chunks = [c for c in stream if c.choices]
    calls = [t for c in chunks for t in c.choices[0].delta.tool_calls or []]
    assert [t.function.name for t in calls] == ["get_weather"] and chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not "".join(c.choices[0].delta.content or "" for c in chunks)  # the call's text is not content
    jsonschema.validate(json.loads(calls[0].function.arguments), CITY)


def test_a_raw_session_answers_with_the_call_inline_as_molts_chat_server(stack):
    """A session opened with replies "raw" (ChatAgentRunner's, for Molt's ChatAgents, which parse calls from the
    content themselves as chat_geo3k.py does): the forced call stays in the text, finish "stop", on both wires;
    the agent sends the text back as the assistant's content with the tool's answer, and the turns stay one
    segment."""
    r = httpx.post(stack["url"] + "/v1/sessions", json={"replies": "raw"})
    assert r.status_code == 201, r.text
    s = r.json()
    client = openai.OpenAI(base_url=s["openai_base_url"], api_key="EMPTY")
    first = client.chat.completions.create(
        model="policy", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=MAX_TOKENS, seed=3
    )
    choice = first.choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls, choice.message
    action = choice.message.content
    assert action.startswith("<tool_call>") and action.rstrip().endswith("</tool_call>"), action
    call = json.loads(action.strip().removeprefix("<tool_call>").removesuffix("</tool_call>"))
    assert call["name"] in ("get_weather", "get_time")
    functions = [t["function"] for t in TOOLS]
    history = [*ASK, {"role": "assistant", "content": action}]
    history.append({"role": "user", "content": "<tool_response>\nSUNNY\n</tool_response>"})
    an = anthropic.Anthropic(base_url=s["anthropic_base_url"], api_key="EMPTY")
    reply = an.messages.create(
        model="policy",
        max_tokens=MAX_TOKENS,
        messages=history,
        tools=[{"name": f["name"], "description": f["description"], "input_schema": CITY} for f in functions],
        tool_choice={"type": "any"},
    )
    [block] = reply.content
    assert block.type == "text" and "<tool_call>" in block.text and reply.stop_reason == "end_turn", reply
    seg = _segment(stack, s["session_id"])
    assert len(seg.action_spans) == 2


def test_an_openai_clients_structured_outputs_extra_body_constrains_as_vllms_server(stack):
    client = openai.OpenAI(base_url=stack["url"] + "/v1", api_key="EMPTY")
    r = client.chat.completions.create(
        model="policy", messages=ASK, max_tokens=12, seed=4, extra_body={"structured_outputs": {"regex": "[0-9]{3}"}}
    )
    assert re.fullmatch("[0-9]{3}", r.choices[0].message.content), r.choices[0].message.content


def test_an_envs_vllm_sampling_params_grammar_and_bias_hold_on_its_token_level_turns(stack):
    """A Molt Env hands back vLLM's own SamplingParams with a grammar (StructuredOutputsParams) and a logit bias:
    the next token-level turn is sampled under both, and the trajectory holds exactly those tokens."""
    vllm_sampling = pytest.importorskip("vllm.sampling_params")
    [no] = stack["model"].encode("no")
    seen: list[str] = []

    class Verdict(Env):
        async def step(self, state):
            seen.append(state["action_text"])
            if len(seen) == 2:
                return Result(reward=1.0, observation="", terminated=True)
            grammar = vllm_sampling.StructuredOutputsParams(choice=["yes", "no", "maybe"])
            sp = vllm_sampling.SamplingParams(max_tokens=8, structured_outputs=grammar, logit_bias={no: 100.0})
            return Result(reward=0.0, observation="Answer yes or no.", terminated=False, sampling_params=sp)

    async def run():
        gateway = GatewayClient(stack["url"])
        episode = Episode(prompt="Is the sky blue?", group_id="g-structured", sampling_params={"max_tokens": 6})
        try:
            return await StepEnvRunner(Verdict).execute(episode, gateway)
        finally:
            await gateway.aclose()

    result = asyncio.run(run())
    assert result.written, result
    assert seen[1].removesuffix("<|im_end|>") == "no", seen  # the choice the bias all but forces
    [traj] = [t for t in read_trajectories(stack["redis"], stack["stream"]) if t.trajectory_id == result.trajectory_id]
    [seg] = traj.segments
    start, end = seg.action_spans[1]
    assert (
        stack["model"].decode(seg.token_ids[start:end].tolist(), skip_special=False).removesuffix("<|im_end|>") == "no"
    )
