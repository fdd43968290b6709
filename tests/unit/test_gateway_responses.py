"""The OpenAI Responses API on a session (in-process app, fake pods): openai-agents' default model runs its
tool loop through it into one token-exact segment; the SDK's streamed events assemble the same response as
the call that is not streamed; what the gateway does not honour is refused by name."""

from __future__ import annotations

import openai
import pytest

from services.gateway.chat import ChatModel
from tests.gateway_testlib import queued_gateway

PODS = ["http://pod-a:1"]
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call><|im_end|>'
TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}


@pytest.fixture(scope="module")
def model(tiny_qwen3) -> ChatModel:
    return ChatModel(tiny_qwen3)


@pytest.fixture
def gw(model):
    return queued_gateway(model, PODS)


async def _client(http) -> tuple[str, openai.AsyncOpenAI]:
    s = (await http.post("/v1/sessions", json={})).json()
    return s["session_id"], openai.AsyncOpenAI(base_url=s["openai_base_url"], api_key="EMPTY", http_client=http)


async def test_openai_agents_default_model_runs_a_tool_loop_into_one_exact_segment(gw, model):
    from agents import Agent, Runner, function_tool, set_default_openai_client, set_tracing_disabled

    app, pods, queue, http = gw
    sid, client = await _client(http)
    set_tracing_disabled(True)
    set_default_openai_client(client, use_for_tracing=False)  # the default model: the Responses API

    @function_tool
    def get_weather(city: str) -> str:
        return f"{city}: sunny"

    generated = [CALL, "Sunny in Paris.<|im_end|>"]
    queue.extend(generated)
    # The default provider's model (OpenAIResponsesModel) under the served name: the default model *name*
    # (a gpt-5 one) adds reasoning-effort and verbosity settings this gateway refuses by name.
    result = await Runner.run(
        Agent(name="weather", instructions="Use tools.", tools=[get_weather], model="policy"), "Weather in Paris?"
    )
    assert result.final_output == "Sunny in Paris."
    done = (await http.post(f"/v1/sessions/{sid}/finish", json={"reward": 1.0})).json()
    assert done["segments"] == 1
    [d] = await app.gateway.queue.read("t", 10, block_s=0)
    [seg] = d.trajectory.segments
    calls = [c for p in pods.pods.values() for c in p.calls]
    ids = seg.token_ids.tolist()
    assert ids == calls[-1][0] + model.encode(generated[-1])
    # function_tool marks its tool strict: each turn's call arguments are held to the tool's schema
    for _, sp in calls:
        [tag] = sp["structured_outputs"]["structural_tag"]["format"]["tags"]
        assert tag["content"]["json_schema"]["properties"] == {"city": {"title": "City", "type": "string"}}
    (s1, e1), (s2, _) = seg.action_spans.tolist()
    assert ids[s1:e1] == model.encode(CALL)
    delta = model.decode(ids[e1:s2], skip_special=False)
    assert delta.startswith("\n<|im_start|>tool\n") and "Paris: sunny" in delta


async def test_streamed_events_assemble_the_response_the_plain_call_returns(gw, model):
    _app, _pods, queue, http = gw
    _, plain = await _client(http)
    _, streamed = await _client(http)
    queue.extend(["Let me check. " + CALL, "Let me check. " + CALL])
    a = await plain.responses.create(
        model="policy", instructions="Use tools.", input="Weather in Paris?", tools=[TOOL]
    )
    assert [o.type for o in a.output] == ["message", "function_call"] and a.output_text == "Let me check."
    assert a.output[1].name == "get_weather" and a.status == "completed"
    async with streamed.responses.stream(
        model="policy", instructions="Use tools.", input="Weather in Paris?", tools=[TOOL]
    ) as st:
        kinds = [ev.type async for ev in st]
        b = await st.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds and "response.function_call_arguments.done" in kinds
    assert b.output_text == a.output_text and b.usage.output_tokens == a.usage.output_tokens
    assert [(o.name, o.arguments) for o in b.output[1:]] == [(o.name, o.arguments) for o in a.output[1:]]


async def test_what_the_responses_wire_does_not_honour_is_refused_by_name(gw):
    _app, _pods, _queue, http = gw
    _, client = await _client(http)
    for kwargs, param in [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"tool_choice": "required"}, "tool_choice"),  # no tools to call
        ({"text": {"format": {"type": "xml"}}}, "text.format"),
        ({"reasoning": {"effort": "low"}}, "reasoning.effort"),  # this template never thinks
        ({"reasoning": {"summary": "auto"}}, "reasoning.summary"),
        ({"text": {"verbosity": "low"}}, "text.verbosity"),
    ]:
        with pytest.raises(openai.BadRequestError) as err:
            await client.responses.create(model="policy", input="hi", **kwargs)
        assert err.value.body["param"] == param
    with pytest.raises(openai.BadRequestError) as err:
        await client.responses.create(model="policy", input=[{"type": "web_search_call", "id": "ws_1"}])
    assert "web_search_call" in err.value.body["message"] and err.value.body["param"] == "input[0]"
    with pytest.raises(openai.BadRequestError) as err:  # a reasoning item is taken (not rendered): nothing left
        await client.responses.create(model="policy", input=[{"type": "reasoning", "id": "rs_1", "summary": []}])
    assert err.value.body["param"] == "input"
