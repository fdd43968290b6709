"""``--gateway.reasoning_field reasoning``: the think block goes out under vLLM's current name, ``reasoning``,
in the reply and in the stream's deltas, and never also as ``reasoning_content`` (a client that reads both would
show it twice). Clients built for vLLM send it back under that name; the capture stays token-exact (in-process
app, fake pods, the real openai SDK and openai-agents)."""

from __future__ import annotations

import openai
import pytest

from services.gateway.chat import ChatModel
from services.gateway.config import GatewaySettings
from tests.gateway_testlib import queued_gateway, thinking_model

PODS = ["http://pod-a:1"]
THINK = "<think>\nThe user wants a number.\n</think>\n\nFour.<|im_end|>"
REASONING = "The user wants a number."


@pytest.fixture(scope="module")
def model(tiny_qwen3, tmp_path_factory) -> ChatModel:
    m = thinking_model(tiny_qwen3, tmp_path_factory.mktemp("thinking") / "model")
    assert m.thinks
    return m


@pytest.fixture
def gw(model):
    return queued_gateway(model, PODS, gateway={"reasoning_field": "reasoning"})


async def _client(http) -> tuple[openai.AsyncOpenAI, str]:
    s = (await http.post("/v1/sessions", json={})).json()
    return openai.AsyncOpenAI(base_url=s["openai_base_url"], api_key="EMPTY", http_client=http), s["session_id"]


async def test_the_reply_names_it_reasoning_and_a_reply_sent_back_so_extends_the_segment(gw, model):
    app, pods, queue, http = gw
    client, sid = await _client(http)
    queue.extend([THINK, "Six.<|im_end|>"])
    msgs = [{"role": "user", "content": "2 + 2?"}]
    r = await client.chat.completions.create(model="policy", messages=msgs)
    msg = r.choices[0].message.model_dump(exclude_none=True)
    assert msg["content"] == "Four." and msg["reasoning"] == REASONING and "reasoning_content" not in msg
    await client.chat.completions.create(model="policy", messages=msgs + [msg, {"role": "user", "content": "3+3?"}])
    assert (await http.post(f"/v1/sessions/{sid}/finish", json={"reward": 1.0})).json()["segments"] == 1
    [d] = await app.gateway.queue.read("t", 10, block_s=0)
    [seg] = d.trajectory.segments
    (s1, e1), _ = seg.action_spans.tolist()
    assert seg.token_ids.tolist()[s1:e1] == model.encode(THINK)


async def test_the_stream_sends_reasoning_deltas_only(gw):
    _app, _pods, queue, http = gw
    client, _ = await _client(http)
    queue.append(THINK)
    stream = await client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": "2 + 2?"}], stream=True
    )
    deltas = [c.choices[0].delta.model_dump(exclude_none=True) async for c in stream if c.choices]
    assert "".join(d.get("reasoning", "") for d in deltas) == REASONING
    assert not any("reasoning_content" in d for d in deltas)
    assert "".join(d.get("content", "") for d in deltas) == "Four."


@pytest.mark.parametrize("stream", [False, True])
async def test_openai_agents_shows_the_reasoning_once(gw, stream):
    """openai-agents reads both names; with one sent, its reasoning item holds the block once."""
    from agents import Agent, OpenAIChatCompletionsModel, Runner, set_tracing_disabled

    _app, _pods, queue, http = gw
    client, _ = await _client(http)
    set_tracing_disabled(True)
    queue.append(THINK)
    agent = Agent(name="a", model=OpenAIChatCompletionsModel(model="policy", openai_client=client))
    if stream:
        result = Runner.run_streamed(agent, "2 + 2?")
        async for _ in result.stream_events():
            pass
    else:
        result = await Runner.run(agent, "2 + 2?")
    assert result.final_output == "Four."
    [item] = [i.raw_item for i in result.new_items if i.type == "reasoning_item"]
    texts = [c.text for c in item.content or []] + [s.text for s in item.summary]
    assert texts == [REASONING]


def test_the_flag_takes_the_two_names_only():
    assert GatewaySettings.model_validate({"gateway": {"reasoning_field": "reasoning"}}).gateway.reasoning_field == (
        "reasoning"
    )
    with pytest.raises(ValueError, match="reasoning_field"):
        GatewaySettings.model_validate({"gateway": {"reasoning_field": "thinking"}})
