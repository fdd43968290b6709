"""Reasoning on the Responses wire, with a template that thinks and has Qwen3's ``enable_thinking`` switch
(in-process app, fake pods, the real openai SDK): the think block is a ``reasoning`` item before the message,
streamed or not (its text in deltas as a pod streams it), counted in ``reasoning_tokens``; ``reasoning.effort``
goes through the switch as chat's ``reasoning_effort`` does; the reasoning items a client sends back keep the
segment token-exact."""

from __future__ import annotations

import openai
import pytest
from openai.types.responses import ResponseReasoningItem, ResponseReasoningTextDeltaEvent

from services.gateway.chat import ChatModel
from tests.gateway_testlib import queued_gateway, stream_steps, thinking_switch_model

PODS = ["http://pod-a:1"]
THINK = "<think>\nThe user wants a number.\n</think>\n\nFour.<|im_end|>"
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call><|im_end|>'
THINK_CALL = "<think>\nAsk the tool.\n</think>\n\n" + CALL
EMPTY_THINK = "<think>\n\n</think>\n\n"
TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}


@pytest.fixture(scope="module")
def model(tiny_qwen3, tmp_path_factory) -> ChatModel:
    """tiny_qwen3 whose generation prompt holds an empty think block when enable_thinking is false (Qwen3's)."""
    m = thinking_switch_model(tiny_qwen3, tmp_path_factory.mktemp("thinking") / "model")
    assert m.thinks and m.template_variables == {"enable_thinking"}
    return m


@pytest.fixture
def gw(model):
    return queued_gateway(model, PODS)


async def _client(http, session: bool) -> openai.AsyncOpenAI:
    url = (await http.post("/v1/sessions", json={})).json()["openai_base_url"] if session else "http://gw/v1"
    return openai.AsyncOpenAI(base_url=url, api_key="EMPTY", http_client=http)


def _thought(model: ChatModel, reply: str) -> int:
    """The reply's tokens up to and with its think block's end tag."""
    return len(model.encode(reply[: reply.index("</think>") + len("</think>")]))


@pytest.mark.parametrize("session", [True, False])
async def test_the_think_block_is_a_reasoning_item_before_the_message(gw, model, session):
    _app, _pods, queue, http = gw
    client = await _client(http, session)
    queue.extend([THINK, THINK_CALL])
    r = await client.responses.create(model="policy", input="2 + 2?")
    assert [o.type for o in r.output] == ["reasoning", "message"] and r.output_text == "Four."
    item = r.output[0]
    assert isinstance(item, ResponseReasoningItem) and item.id.startswith("rs_") and item.summary == []
    assert [(c.type, c.text) for c in item.content or []] == [("reasoning_text", "The user wants a number.")]
    assert r.usage.output_tokens_details.reasoning_tokens == _thought(model, THINK) > 0
    assert r.usage.output_tokens == len(model.encode(THINK))
    r = await client.responses.create(model="policy", input="Weather in Paris?", tools=[TOOL])
    assert [o.type for o in r.output] == ["reasoning", "function_call"] and r.output_text == ""
    assert r.output[0].content[0].text == "Ask the tool." and r.output[1].name == "get_weather"


def _shape(item) -> tuple:
    if item.type == "function_call":
        return item.type, item.name, item.arguments
    return item.type, item.status, [(c.type, c.text) for c in item.content]


@pytest.mark.parametrize("session", [True, False])
@pytest.mark.parametrize("reply", [THINK, THINK_CALL])
async def test_the_stream_sends_the_reasoning_item_first_and_assembles_the_plain_response(gw, session, reply):
    _app, _pods, queue, http = gw
    client = await _client(http, session)
    queue.extend([reply, reply, reply])
    args = {"model": "policy", "input": "2 + 2?", "tools": [TOOL]}
    plain = await client.responses.create(**args)
    async with client.responses.stream(**args) as st:
        kinds = [ev.type async for ev in st]
        final = await st.get_final_response()
    assert kinds[-1] == "response.completed" and "response.reasoning_text.done" in kinds
    assert [_shape(o) for o in final.output] == [_shape(o) for o in plain.output]
    assert final.output_text == plain.output_text and final.usage == plain.usage
    events = [ev async for ev in await client.responses.create(**args, stream=True)]
    [delta] = [ev for ev in events if isinstance(ev, ResponseReasoningTextDeltaEvent)]
    assert delta.output_index == 0 and delta.delta == plain.output[0].content[0].text
    added = [(ev.output_index, ev.item.type) for ev in events if ev.type == "response.output_item.added"]
    assert added == list(enumerate(o.type for o in plain.output))
    assert [ev.sequence_number for ev in events] == list(range(len(events)))


LONG_THINK = "<think>\nTwo and two make four, so the user wants to read the number four.\n</think>\n\n"


def _runs(kinds: list[str]) -> list[str]:
    """The event types, each run of deltas as one."""
    return [k for i, k in enumerate(kinds) if not (k.endswith(".delta") and i and kinds[i - 1] == k)]


@pytest.mark.parametrize(
    "reply, tools, limit",
    [
        (LONG_THINK + "Four, as two plus two is four.<|im_end|>", None, None),
        (LONG_THINK + CALL, [TOOL], None),
        (LONG_THINK, None, 12),  # a length stop inside the think block
    ],
)
async def test_the_reasoning_streams_as_the_pod_generates_it(gw, reply, tools, limit):
    """With the pod streaming a session's turn, the think block's text arrives in deltas while it is generated,
    its item done before the message or call items open (OpenAI's order), and the SDK assembles the response
    the same turn gets unstreamed."""
    app, pods, queue, http = gw
    stream_steps(app, pods)
    client = await _client(http, True)
    queue.extend([reply, reply])
    args = {"model": "policy", "input": "2 + 2?", "tools": tools or [], "max_output_tokens": limit}
    plain = await client.responses.create(**args)
    async with client.responses.stream(**args) as st:
        events = [ev async for ev in st]
        # the SDK assembles a completed response only (response.incomplete carries its own)
        final = events[-1].response if limit else await st.get_final_response()
    thought = [ev for ev in events if ev.type == "response.reasoning_text.delta"]
    assert len(thought) > 3 and "".join(ev.delta for ev in thought) == plain.output[0].content[0].text
    assert {(ev.output_index, ev.item_id) for ev in thought} == {(0, final.output[0].id)}
    reasoning = ["output_item.added", "content_part.added", "reasoning_text.delta", "reasoning_text.done"]
    reasoning += ["content_part.done", "output_item.done"]
    message = ["output_item.added", "content_part.added", "output_text.delta", "output_text.done"]
    message += ["content_part.done", "output_item.done"]
    call = ["output_item.added", "function_call_arguments.delta", "function_call_arguments.done", "output_item.done"]
    then = call if tools else message if limit is None else [m for m in message if m != "output_text.delta"]
    end = "incomplete" if limit else "completed"
    expected = ["created", "in_progress", *reasoning, *then, end]
    assert _runs([ev.type for ev in events]) == ["response." + k for k in expected]
    assert [ev.sequence_number for ev in events] == list(range(len(events)))
    assert [_shape(o) for o in final.output] == [_shape(o) for o in plain.output]
    assert final.output_text == plain.output_text and final.usage == plain.usage and final.status == plain.status


async def test_reasoning_items_sent_back_keep_the_segment_exact(gw, model):
    """openai-agents sends the output items back, the reasoning item included; it is not rendered (the template
    decides what earlier turns show), and the next turn extends the segment token-exactly."""
    from agents import Agent, Runner, function_tool, set_default_openai_client, set_tracing_disabled

    app, pods, queue, http = gw
    s = (await http.post("/v1/sessions", json={})).json()
    client = openai.AsyncOpenAI(base_url=s["openai_base_url"], api_key="EMPTY", http_client=http)
    set_tracing_disabled(True)
    set_default_openai_client(client, use_for_tracing=False)

    @function_tool
    def get_weather(city: str) -> str:
        return f"{city}: sunny"

    queue.extend([THINK_CALL, THINK])
    agent = Agent(name="weather", instructions="Use tools.", tools=[get_weather], model="policy")
    result = await Runner.run(agent, "Weather in Paris?")
    assert result.final_output == "Four."
    sent = result.to_input_list()
    assert [i.get("type") for i in sent].count("reasoning") == 2
    assert (await http.post(f"/v1/sessions/{s['session_id']}/finish", json={"reward": 1.0})).json()["segments"] == 1
    [d] = await app.gateway.queue.read("t", 10, block_s=0)
    [seg] = d.trajectory.segments
    ids = seg.token_ids.tolist()
    (s1, e1), (s2, e2) = seg.action_spans.tolist()
    calls = [c for p in pods.pods.values() for c in p.calls]
    assert ids[s1:e1] == model.encode(THINK_CALL) and ids == calls[-1][0] + ids[s2:e2]


def _prompts(model: ChatModel, pods) -> list[str]:
    return [model.decode(prompt, skip_special=False) for prompt, _ in pods.pods[PODS[0]].calls]


@pytest.mark.parametrize("session", [True, False])
@pytest.mark.parametrize("stream", [False, True])
async def test_reasoning_effort_goes_through_the_templates_switch(gw, model, session, stream):
    _app, pods, _queue, http = gw
    client = await _client(http, session)
    for i, (effort, empty_think) in enumerate([("none", True), ("low", False), (None, False)]):
        args = {"model": "policy", "input": f"{i} + 2?", "reasoning": {"effort": effort} if effort else None}
        if stream:
            async with client.responses.stream(**{k: v for k, v in args.items() if v is not None}) as st:
                r = await st.get_final_response()
        else:
            r = await client.responses.create(**{k: v for k, v in args.items() if v is not None})
        assert _prompts(model, pods)[-1].endswith(EMPTY_THINK) == empty_think
        assert (r.reasoning.effort if r.reasoning else None) == effort


async def test_what_reasoning_and_text_cannot_honour_is_refused_by_name(gw):
    _app, pods, _queue, http = gw
    client = await _client(http, True)
    for kwargs, param in [
        ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
        ({"reasoning": {"effort": "low", "summary": "auto"}}, "reasoning.summary"),
        ({"reasoning": {"generate_summary": "concise"}}, "reasoning.generate_summary"),
        ({"reasoning": {"context": "all_turns"}}, "reasoning.context"),
        ({"reasoning": "high"}, "reasoning"),
        ({"text": {"verbosity": "low"}}, "text.verbosity"),
        ({"text": {"format": {"type": "text"}, "verbosity": "high"}}, "text.verbosity"),
    ]:
        with pytest.raises(openai.BadRequestError) as err:
            await client.responses.create(model="policy", input="hi", **kwargs)
        assert err.value.body["param"] == param, err.value.body
    assert not pods.pods[PODS[0]].calls
    r = await client.responses.create(
        model="policy", input="hi", reasoning={"effort": "high", "summary": None, "context": "auto"}, text={}
    )
    assert r.status == "completed"
