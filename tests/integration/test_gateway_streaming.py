"""True streaming through the gateway: a real pod (vLLM, tiny model) streams a turn's tokens to the gateway as
it generates them, and the gateway passes them on, on both wires, with the real openai/anthropic SDKs. The
first content reaches the client while the turn is still running (the session has not committed it yet), and
the streamed turn records exactly what the same turn not streamed records."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from tests.gateway_testlib import pod_and_gateway, read_trajectories

pytestmark = [pytest.mark.vllm, pytest.mark.redis, pytest.mark.timeout(300)]

MESSAGES = [{"role": "user", "content": "Tell me a long story."}]
LONG = 160


@pytest.fixture(scope="module")
def stack(tiny_qwen3, redis_url, tmp_path_factory):
    logs = tmp_path_factory.mktemp("gw-stream")
    with pod_and_gateway(tiny_qwen3, logs, redis_url, "gateway-stream") as (url, _, stream):
        yield {"url": url, "redis": redis_url, "stream": stream}


def _open(stack, **sampling) -> dict:
    # ignore_eos: the random tiny model would end a turn at any token; these turns must be long.
    r = httpx.post(stack["url"] + "/v1/sessions", json={"sampling_params": {"ignore_eos": True, **sampling}})
    assert r.status_code == 201, r.text
    return r.json()


def _turns(stack, sid: str) -> int:
    return httpx.get(f"{stack['url']}/v1/sessions/{sid}").json()["turns"]


def _segments(stack, sid: str) -> list[tuple[list[int], list[float], list[list[int]]]]:
    assert httpx.post(f"{stack['url']}/v1/sessions/{sid}/finish", json={"reward": 1.0}).json()["written"]
    [traj] = [t for t in read_trajectories(stack["redis"], stack["stream"]) if t.trajectory_id == sid]
    return [(s.token_ids.tolist(), s.logprobs.tolist(), s.action_spans.tolist()) for s in traj.segments]


def test_openai_stream_arrives_while_generating_and_records_what_the_plain_call_records(stack):
    plain, streamed = _open(stack), _open(stack)
    a = openai.OpenAI(base_url=plain["openai_base_url"], api_key="EMPTY").chat.completions.create(
        model="policy", messages=MESSAGES, max_tokens=LONG, seed=11, temperature=1.0
    )
    client = openai.OpenAI(base_url=streamed["openai_base_url"], api_key="EMPTY")
    pieces, turns_at_first, usage, finish = [], None, None, None
    for chunk in client.chat.completions.create(
        model="policy",
        messages=MESSAGES,
        max_tokens=LONG,
        seed=11,
        temperature=1.0,
        stream=True,
        stream_options={"include_usage": True},
    ):
        if chunk.usage is not None:
            usage = chunk.usage
        if not chunk.choices:
            continue
        if chunk.choices[0].delta.content:
            if turns_at_first is None:
                turns_at_first = _turns(stack, streamed["session_id"])
            pieces.append(chunk.choices[0].delta.content)
        finish = chunk.choices[0].finish_reason or finish
    assert turns_at_first == 0  # the first text arrived before the turn was done (committed)
    assert len(pieces) > 10
    assert "".join(pieces) == a.choices[0].message.content and finish == a.choices[0].finish_reason == "length"
    assert usage.model_dump() == a.usage.model_dump() and usage.completion_tokens == LONG
    assert _segments(stack, streamed["session_id"]) == _segments(stack, plain["session_id"])


def test_anthropic_stream_arrives_while_generating_and_records_what_the_plain_call_records(stack):
    # The Anthropic wire has no seed: greedy sessions make the two calls comparable.
    plain, streamed = _open(stack, temperature=0.0), _open(stack, temperature=0.0)
    a = anthropic.Anthropic(base_url=plain["anthropic_base_url"], api_key="EMPTY").messages.create(
        model="policy", messages=MESSAGES, max_tokens=LONG
    )
    client = anthropic.Anthropic(base_url=streamed["anthropic_base_url"], api_key="EMPTY")
    pieces, turns_at_first = [], None
    with client.messages.stream(model="policy", messages=MESSAGES, max_tokens=LONG) as st:
        for text in st.text_stream:
            if turns_at_first is None:
                turns_at_first = _turns(stack, streamed["session_id"])
            pieces.append(text)
        final = st.get_final_message()
    assert turns_at_first == 0 and len(pieces) > 10
    assert "".join(pieces) == a.content[0].text == final.content[0].text
    assert final.stop_reason == a.stop_reason == "max_tokens" and final.usage.output_tokens == LONG
    assert _segments(stack, streamed["session_id"]) == _segments(stack, plain["session_id"])


def test_a_streamed_turn_the_pod_refuses_is_an_http_400_and_the_session_goes_on(stack):
    """The pod refuses what it cannot serve (a token id past the vocabulary, a schema its grammar backend cannot
    compile) before generating: a streamed call gets the 400 as its status on every wire (as from vLLM), not a
    200 and an error event, and nothing is recorded."""
    s = _open(stack)
    client = openai.OpenAI(base_url=s["openai_base_url"], api_key="EMPTY", max_retries=0)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model="policy", messages=MESSAGES, max_tokens=4, stream=True, logit_bias={"99999999": 5}
        )
    schema = {"type": "object", "properties": {"x": {"type": "string", "pattern": "(?<=a)b"}}, "required": ["x"]}
    with pytest.raises(openai.BadRequestError):
        client.responses.create(
            model="policy",
            input="hi",
            max_output_tokens=4,
            stream=True,
            text={"format": {"type": "json_schema", "name": "x", "schema": schema}},
        )
    an = anthropic.Anthropic(base_url=s["anthropic_base_url"], api_key="EMPTY", max_retries=0)
    with pytest.raises(anthropic.BadRequestError):
        an.messages.create(
            model="policy",
            max_tokens=4,
            messages=MESSAGES,
            stream=True,
            tools=[{"name": "f", "input_schema": schema}],
            tool_choice={"type": "tool", "name": "f"},
        )
    assert _turns(stack, s["session_id"]) == 0
    text = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(model="policy", messages=MESSAGES, max_tokens=4, stream=True)
        if c.choices
    )
    assert text and _turns(stack, s["session_id"]) == 1
