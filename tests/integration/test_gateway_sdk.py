"""Gateway + a real rollout pod (vLLM, tiny model) + real Redis, driven by the real openai/anthropic SDKs.

Token-exactness is checked two ways: the trajectory's logprobs equal what the pod returned (through the
OpenAI ``logprobs`` field), and re-running each action span's prefix on the pod with the same seed gives
back the recorded action tokens. The random tiny model never writes a well-formed tool call, so tool use
is driven from the client side: assistant tool-call messages in the history (rendered back through the
template) and several tool results appended in one turn. Parsing model-written tool calls into
``tool_calls`` / ``tool_use`` is covered with a scripted pod in tests/unit/test_gateway_app.py.
"""

from __future__ import annotations

import asyncio
import re

import anthropic
import httpx
import numpy as np
import openai
import pytest

from services.gateway.chat import ChatModel
from tests.docs_snippets import python_blocks
from tests.gateway_testlib import pod_and_gateway, read_trajectories

pytestmark = [pytest.mark.vllm, pytest.mark.redis]

CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": CITY}}
]
HISTORY = [
    {"role": "system", "content": "You are a weather bot."},
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "call_p", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "paris"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_p", "content": "PARIS_SUNNY"},
]


@pytest.fixture(scope="module")
def stack(tiny_qwen3, redis_url, tmp_path_factory):
    with pod_and_gateway(tiny_qwen3, tmp_path_factory.mktemp("gw"), redis_url, "gateway-sdk") as (
        url,
        pod_url,
        stream,
    ):
        yield {"url": url, "pod": pod_url, "redis": redis_url, "stream": stream, "model": ChatModel(tiny_qwen3)}


def _open(stack, **body) -> dict:
    r = httpx.post(stack["url"] + "/v1/sessions", json=body)
    assert r.status_code == 201, r.text
    return r.json()


def _finish(stack, sid: str, reward: float = 1.0) -> dict:
    r = httpx.post(f"{stack['url']}/v1/sessions/{sid}/finish", json={"reward": reward})
    assert r.status_code == 200, r.text
    return r.json()


def _read(stack, sid: str):
    [traj] = [t for t in read_trajectories(stack["redis"], stack["stream"]) if t.trajectory_id == sid]
    return traj


def _replay(stack, token_ids: list[int], start: int, end: int, seed: int, max_tokens: int) -> dict:
    """Re-run one action span's prefix directly on the pod with the same sampling parameters."""
    r = httpx.post(
        stack["pod"] + "/v1/generate",
        json={
            "prompt_token_ids": token_ids[:start],
            "sampling_params": {"max_tokens": max_tokens, "temperature": 1.0, "top_p": 1.0, "seed": seed},
        },
        timeout=60,
    )
    return r.json()["outputs"][0]


def test_openai_sync_multi_turn_with_tools_is_token_exact(stack):
    s = _open(stack, group_id="grp", env_name="weather", env_version="2")
    client = openai.OpenAI(base_url=s["openai_base_url"], api_key="EMPTY")
    messages = [dict(m) for m in HISTORY]
    replies = []
    for turn in range(3):
        r = client.chat.completions.create(
            model="policy", messages=messages, tools=TOOLS, max_tokens=12, seed=7, logprobs=True
        )
        replies.append(r)
        msg = r.choices[0].message.model_dump(exclude_none=True)
        if turn == 0:  # two tool results in one turn: both must be in the token stream
            new = [
                {"role": "tool", "tool_call_id": "call_r", "content": "ROME_RAINY"},
                {"role": "tool", "tool_call_id": "call_x", "content": "BERLIN_COLD"},
            ]
        else:
            new = [{"role": "user", "content": f"And now turn {turn}?"}]
        messages += [msg] + new
    info = _finish(stack, s["session_id"])
    assert info["written"] and info["segments"] == 1
    traj = _read(stack, s["session_id"])
    model = stack["model"]
    assert (traj.group_id, traj.provenance.env_name, traj.provenance.env_version) == ("grp", "weather", "2")
    assert traj.provenance.chat_template_hash == model.chat_template_hash
    assert [e["kind"] for e in traj.events] == ["pod"]  # the pod that served it (mismatch KL is labelled by it)
    [seg] = traj.segments
    ids = seg.token_ids.tolist()
    spans = seg.action_spans.tolist()
    assert len(spans) == 3
    offset = 0
    for (start, end), r in zip(spans, replies):
        pod_lps = np.array([c.logprob for c in r.choices[0].logprobs.content], dtype=np.float32)
        np.testing.assert_array_equal(seg.logprobs[offset : offset + end - start], pod_lps)
        offset += end - start
        content = (r.choices[0].message.content or "").strip()
        assert model.decode(ids[start:end], skip_special=True).strip() == content or r.choices[0].message.tool_calls
        again = _replay(stack, ids, start, end, seed=7, max_tokens=12)
        assert again["token_ids"] == ids[start:end]
    # The prompt renders the client's tool call through the template; the deltas hold every new message.
    prompt = model.decode(ids[: spans[0][0]], skip_special=False)
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "paris"}}</tool_call>' in prompt
    assert "PARIS_SUNNY" in prompt
    delta1 = model.decode(ids[spans[0][1] : spans[1][0]], skip_special=False)
    assert delta1.index("ROME_RAINY") < delta1.index("BERLIN_COLD") and delta1.endswith("<|im_start|>assistant\n")
    assert "And now turn 1?" in model.decode(ids[spans[1][1] : spans[2][0]], skip_special=False)
    assert (seg.versions == 0).all()


def test_openai_async_streaming_and_idempotent_retry(stack):
    s = _open(stack)

    async def run():
        client = openai.AsyncOpenAI(base_url=s["openai_base_url"], api_key="EMPTY")
        messages = [{"role": "user", "content": "Tell me a story."}]
        texts = []
        for turn in range(2):
            stream = await client.chat.completions.create(
                model="policy", messages=messages, max_tokens=10, seed=3, stream=True
            )
            text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
            texts.append(text)
            if turn == 0:  # an identical retry (the SDK numbers its attempts) is answered from the cache
                again = await client.chat.completions.create(
                    model="policy",
                    messages=messages,
                    max_tokens=10,
                    seed=3,
                    extra_headers={"x-stainless-retry-count": "1"},
                )
                assert again.choices[0].message.content == text
            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "More."}]
        await client.close()
        return texts

    texts = asyncio.run(run())
    _finish(stack, s["session_id"])
    [seg] = _read(stack, s["session_id"]).segments
    assert len(seg.action_spans) == 2  # the retry generated nothing
    for (start, end), text in zip(seg.action_spans.tolist(), texts):
        assert stack["model"].decode(seg.token_ids[start:end].tolist(), skip_special=True) == text


def test_anthropic_sync_and_streaming_with_tool_blocks(stack):
    s = _open(stack)
    client = anthropic.Anthropic(base_url=s["anthropic_base_url"], api_key="EMPTY")
    tools = [{"name": "get_weather", "description": "Weather of a city", "input_schema": {"type": "object"}}]
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "oslo"}}],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "OSLO_SNOW"}]},
    ]
    m1 = client.messages.create(model="policy", max_tokens=12, system="Be brief.", messages=messages, tools=tools)
    assert m1.usage.output_tokens > 0 and m1.stop_reason in ("end_turn", "max_tokens", "tool_use")
    messages += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m1.content]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_2", "content": "EXTRA_ONE"},
                {"type": "tool_result", "tool_use_id": "toolu_3", "content": [{"type": "text", "text": "EXTRA_TWO"}]},
                {"type": "text", "text": "Summarize."},
            ],
        },
    ]
    with client.messages.stream(
        model="policy", max_tokens=12, system="Be brief.", messages=messages, tools=tools
    ) as st:
        text = "".join(st.text_stream)
        final = st.get_final_message()
    assert final.usage.output_tokens > 0
    _finish(stack, s["session_id"])
    [seg] = _read(stack, s["session_id"]).segments
    ids = seg.token_ids.tolist()
    (a0, a1), (b0, b1) = seg.action_spans.tolist()
    model = stack["model"]
    prompt = model.decode(ids[:a0], skip_special=False)
    assert "Be brief." in prompt and '"city": "oslo"' in prompt and "OSLO_SNOW" in prompt
    delta = model.decode(ids[a1:b0], skip_special=False)
    assert delta.index("EXTRA_ONE") < delta.index("EXTRA_TWO") < delta.index("Summarize.")
    assert model.decode(ids[b0:b1], skip_special=True).strip() == text.strip() or final.stop_reason == "tool_use"


def test_compaction_starts_second_segment(stack):
    s = _open(stack)
    client = openai.OpenAI(base_url=s["openai_base_url"], api_key="EMPTY")
    messages = [{"role": "user", "content": "A long conversation starts here."}]
    r1 = client.chat.completions.create(model="policy", messages=messages, max_tokens=8)
    messages += [r1.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Go on."}]
    client.chat.completions.create(model="policy", messages=messages, max_tokens=8)
    compacted = [
        {"role": "system", "content": "Summary of earlier turns: a chat."},
        {"role": "user", "content": "Continue from the summary."},
    ]
    client.chat.completions.create(model="policy", messages=compacted, max_tokens=8)
    info = _finish(stack, s["session_id"], reward=0.25)
    assert info["segments"] == 2
    traj = _read(stack, s["session_id"])
    assert [len(seg.action_spans) for seg in traj.segments] == [2, 1] and traj.reward == 0.25
    second = stack["model"].decode(traj.segments[1].token_ids.tolist(), skip_special=False)
    assert second.startswith("<|im_start|>system\nSummary of earlier turns")


def test_bad_requests_get_4xx(stack):
    s = _open(stack, max_length=48)
    client = openai.OpenAI(base_url=s["openai_base_url"], api_key="EMPTY", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="context"):
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "many words " * 40}])
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="policy", messages=[])
    gone = openai.OpenAI(base_url=stack["url"] + "/s/0123/v1", api_key="EMPTY", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        gone.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}])
    an = anthropic.Anthropic(base_url=stack["url"] + "/s/0123", api_key="EMPTY", max_retries=0)
    with pytest.raises(anthropic.NotFoundError):
        an.messages.create(model="policy", max_tokens=4, messages=[{"role": "user", "content": "x"}])
    r = httpx.post(
        s["openai_base_url"] + "/chat/completions", content=b"{oops", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert r.headers["x-molt-policy-version"] == "0"
    assert _finish(stack, s["session_id"])["written"] is False


@pytest.mark.parametrize(
    ("page", "host", "group"), [("gateway.md", "http://gw:8000", "g7"), ("deploy.md", None, "task-17")]
)
def test_the_session_snippet_of_the_docs_runs_as_written(stack, page, host, group, monkeypatch):
    """What docs/gateway.md and docs/deploy.md show an agent developer, run with only the gateway's address
    changed: one captured turn through the stock OpenAI SDK, then a finish that writes the trajectory."""
    [block] = python_blocks(page)
    if host is None:  # deploy.md names the port-forwarded gateway and reads the key from the environment
        host = re.search(r'base_url="(http://[^"]+)"', block).group(1)  # type: ignore[union-attr]
        monkeypatch.setenv("MOLT_KEY", "any-key")  # this gateway runs without keys: a bearer is ignored
    assert host in block
    exec(compile(block.replace(host, stack["url"]), f"docs/{page}", "exec"), {})
    [traj] = [t for t in read_trajectories(stack["redis"], stack["stream"]) if t.group_id == group]
    assert traj.reward == 1.0 and traj.num_action_tokens > 0
