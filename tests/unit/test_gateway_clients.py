"""Agent libraries as their users run them, against the gateway app in-process (fake pods, memory queue):
whatever a library does to the history it echoes, the trajectory holds the pod's tokens plus the template's
exact deltas in one segment."""

from __future__ import annotations

import anthropic
import httpx2
import openai
import pytest

from services.gateway.chat import ChatModel
from tests.gateway_testlib import FakePods, queued_gateway

PODS = ["http://pod-a:1"]


@pytest.fixture(scope="module")
def model(tiny_qwen3) -> ChatModel:
    return ChatModel(tiny_qwen3)


@pytest.fixture
def gw(model):
    return queued_gateway(model, PODS)


async def _session(http) -> dict:
    r = await http.post("/v1/sessions", json={})
    assert r.status_code == 201, r.text
    return r.json()


async def _one_segment(app, http, sid: str, pods: FakePods, model: ChatModel, generated: list[str]) -> list[int]:
    """Finish ``sid``; its single segment must be the last prompt the pod saw plus the last generation, and every
    generation must sit in it verbatim, each followed by the template's newline after <|im_end|>."""
    r = await http.post(f"/v1/sessions/{sid}/finish", json={"reward": 1.0})
    assert r.json()["segments"] == 1, r.json()
    [d] = await app.gateway.queue.read("t", 10, block_s=0)
    [seg] = d.trajectory.segments
    ids = seg.token_ids.tolist()
    calls = [c for p in pods.pods.values() for c in p.calls]
    assert ids == calls[-1][0] + model.encode(generated[-1])
    for (start, end), text in zip(seg.action_spans.tolist(), generated):
        assert ids[start:end] == model.encode(text)
    for _, end in seg.action_spans.tolist()[:-1]:
        assert model.decode(ids[end - 1 : end + 1], skip_special=False) == "<|im_end|>\n"
    return ids


async def test_pydantic_ai_tool_loop_with_reserialised_arguments_is_token_exact(gw, model):
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    app, pods, queue, http = gw
    s = await _session(http)
    client = openai.AsyncOpenAI(base_url=s["openai_base_url"], api_key="EMPTY", http_client=http)
    agent = Agent(
        OpenAIChatModel("policy", provider=OpenAIProvider(openai_client=client)), system_prompt="Use the tool."
    )

    @agent.tool_plain
    def get_weather(city: str) -> str:
        return f"{city}: sunny"

    generated = [
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call><|im_end|>',
        "Sunny in Paris.<|im_end|>",
    ]
    queue.extend(generated)
    result = await agent.run("Weather in Paris?")
    assert result.output == "Sunny in Paris."
    # pydantic-ai sends the call back as '{"city":"Paris"}': compact, unlike what the model wrote.
    second_prompt = [c for p in pods.pods.values() for c in p.calls][1][0]
    assert '"arguments": {"city":"Paris"}' not in model.decode(second_prompt, skip_special=False)
    await _one_segment(app, http, s["session_id"], pods, model, generated)


async def test_langchain_tool_loop_is_token_exact_and_its_tool_schemas_render_as_sent(gw, model):
    """LangChain's ChatOpenAI with bound tools, the way a LangGraph ReAct node calls it: the call comes back as an
    AIMessage with tool_calls, the result as a ToolMessage; one segment, every generation verbatim. Its tool
    schema's key order is the one the prompt renders, not that of an earlier session's cached first turn."""
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    app, pods, queue, http = gw

    @tool
    def get_weather(city: str) -> str:
        """Weather of a city."""
        return f"{city}: sunny"

    # Another client's first turn with the same tool in the usual key order fills the prompt cache first.
    other = await _session(http)
    schema = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
    queue.append("Hi.<|im_end|>")
    r = await http.post(
        f"/s/{other['session_id']}/v1/chat/completions",
        json={"model": "policy", "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [schema]},
    )
    assert r.status_code == 200, r.text
    pods.pods[PODS[0]].calls.clear()

    s = await _session(http)
    llm = ChatOpenAI(
        model="policy", base_url=s["openai_base_url"], api_key="EMPTY", http_async_client=http, max_retries=0
    ).bind_tools([get_weather])
    generated = [
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call><|im_end|>',
        "Sunny in Paris.<|im_end|>",
    ]
    queue.extend(generated)
    history = [HumanMessage("Weather in Paris?")]
    ai = await llm.ainvoke(history)
    assert [c["name"] for c in ai.tool_calls] == ["get_weather"] and ai.tool_calls[0]["args"] == {"city": "Paris"}
    history += [ai, ToolMessage(get_weather.invoke(ai.tool_calls[0]["args"]), tool_call_id=ai.tool_calls[0]["id"])]
    final = await llm.ainvoke(history)
    assert final.content == "Sunny in Paris."
    first_prompt = model.decode([c for p in pods.pods.values() for c in p.calls][0][0], skip_special=False)
    # LangChain orders the parameters' keys properties, required, type: the prompt renders that order.
    assert '"parameters": {"properties": {"city"' in first_prompt
    assert '"parameters": {"type": "object"' not in first_prompt
    await _one_segment(app, http, s["session_id"], pods, model, generated)


async def test_anthropic_tool_use_echo_of_compact_model_json_is_token_exact(gw, model):
    app, pods, queue, http = gw
    s = await _session(http)
    an = anthropic.AsyncAnthropic(
        base_url=s["anthropic_base_url"],
        api_key="EMPTY",
        http_client=httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://gw"),
    )
    # The model writes compact JSON; the SDK's tool_use input comes back as an object the wire re-serialises.
    generated = [
        '<tool_call>{"name":"get_weather","arguments":{"unit":"C","city":"Rome"}}</tool_call><|im_end|>',
        "Warm.<|im_end|>",
    ]
    queue.extend(generated)
    tools = [{"name": "get_weather", "description": "w", "input_schema": {"type": "object"}}]
    msgs = [{"role": "user", "content": "Weather in Rome?"}]
    m1 = await an.messages.create(model="policy", max_tokens=64, messages=msgs, tools=tools)
    use = m1.content[-1]
    msgs += [
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": use.id, "name": use.name, "input": {"city": "Rome", "unit": "C"}}],
        },  # keys reordered
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "warm"}]},
    ]
    m2 = await an.messages.create(model="policy", max_tokens=64, messages=msgs, tools=tools)
    assert m2.content[0].text == "Warm."
    await _one_segment(app, http, s["session_id"], pods, model, generated)


async def test_anthropic_stop_reason_follows_the_spec(gw, model):
    app, _pods, queue, http = gw
    s = await _session(http)
    an = anthropic.AsyncAnthropic(
        base_url=s["anthropic_base_url"],
        api_key="EMPTY",
        http_client=httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://gw"),
    )
    msgs = [{"role": "user", "content": "Count."}]
    queue.extend(["one two END three<|im_end|>", "one two END three<|im_end|>", "one<|im_end|>", "a b c d e f"])
    m = await an.messages.create(model="policy", max_tokens=64, messages=msgs, stop_sequences=["END", "XYZ"])
    assert (m.stop_reason, m.stop_sequence, m.content[0].text) == ("stop_sequence", "END", "one two ")
    async with an.messages.stream(
        model="policy",
        max_tokens=64,
        messages=msgs + [{"role": "assistant", "content": "one two "}, {"role": "user", "content": "Again."}],
        stop_sequences=["END"],
    ) as st:
        final = await st.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", "END")
    s2 = await _session(http)
    an2 = an.with_options(base_url=s2["anthropic_base_url"])
    m = await an2.messages.create(model="policy", max_tokens=64, messages=msgs, stop_sequences=["END"])
    assert (m.stop_reason, m.stop_sequence) == ("end_turn", None)
    m = await an2.messages.create(
        model="policy",
        max_tokens=2,
        messages=msgs + [{"role": "assistant", "content": m.content[0].text}, {"role": "user", "content": "More."}],
    )
    assert (m.stop_reason, m.stop_sequence) == ("max_tokens", None)


async def test_completions_echo_puts_the_prompt_before_the_text(gw, model):
    _app, _pods, queue, http = gw
    s = await _session(http)
    oa = openai.AsyncOpenAI(base_url=s["openai_base_url"], api_key="EMPTY", http_client=http)
    queue.extend([" upon a time", " there was"])
    c = await oa.completions.create(model="policy", prompt="Once", max_tokens=8, echo=True)
    assert c.choices[0].text == "Once upon a time"
    stream = await oa.completions.create(
        model="policy", prompt="Once upon a time and", max_tokens=8, echo=True, stream=True
    )
    assert "".join([ch.choices[0].text async for ch in stream]) == "Once upon a time and there was"
    with pytest.raises(openai.BadRequestError) as err:
        await oa.completions.create(model="policy", prompt="x", max_tokens=8, echo=True, logprobs=1)
    assert err.value.body["param"] == "echo"
