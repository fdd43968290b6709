"""Prefill: a turn that continues a final assistant message (Anthropic's last assistant message, vLLM's
``continue_final_message``). The pod's prompt ends with the open prefill, the answer holds only the
continuation, and a next turn that sends prefill + continuation back as one assistant message extends the same
segment token-exactly: the prefill's tokens are prompt, the continuation's are the action (in-process app, fake
pods, the real SDKs)."""

from __future__ import annotations

import anthropic
import openai
import pytest

from services.gateway.chat import ChatModel
from tests.gateway_testlib import queued_gateway

PODS = ["http://pod-a:1"]
PREFILL = '{"a": '
CONT = '"b"}'
OPEN = {"add_generation_prompt": False, "continue_final_message": True}


@pytest.fixture(scope="module")
def model(tiny_qwen3) -> ChatModel:
    return ChatModel(tiny_qwen3)


@pytest.fixture
def gw(model):
    app, pods, queue, http = queued_gateway(model, PODS)
    return app, pods.pods[PODS[0]], queue, http


async def _open(http) -> dict:
    r = await http.post("/v1/sessions", json={})
    assert r.status_code == 201, r.text
    return r.json()


async def _one_segment(app, http, pod, model, sid: str) -> None:
    """Two turns, one segment: the first prompt ends with the open prefill (prompt tokens), the continuation is
    the first action span, the second prompt extends the first with it exactly."""
    summary = (await http.get(f"/v1/sessions/{sid}")).json()
    assert (summary["turns"], summary["segments"]) == (2, 1)
    (p1, _), (p2, _) = pod.calls
    assert model.decode(p1, skip_special=False).endswith("<|im_start|>assistant\n" + PREFILL)
    g1 = model.encode(CONT + "<|im_end|>")
    assert p2[: len(p1) + len(g1)] == p1 + g1
    await http.post(f"/v1/sessions/{sid}/finish", json={"reward": 1.0})
    [d] = await app.gateway.queue.read("t", 10, block_s=0)
    [seg] = d.trajectory.segments
    ids = seg.token_ids.tolist()
    (s1, e1), (s2, _) = seg.action_spans.tolist()
    assert ids[:s1] == p1 and ids[s1:e1] == g1 and s2 == len(p2)
    assert model.decode(ids[:s1], skip_special=False).endswith(PREFILL)  # the prefill is prompt, not action


async def test_anthropic_prefill_continues_and_extends_the_segment(gw, model):
    app, pod, queue, http = gw
    s = await _open(http)
    an = anthropic.AsyncAnthropic(base_url=s["anthropic_base_url"], api_key="EMPTY", http_client=http.anthropic)
    queue[:] = [CONT + "<|im_end|>", "Done.<|im_end|>"]
    msgs = [{"role": "user", "content": "JSON please"}, {"role": "assistant", "content": PREFILL}]
    m1 = await an.messages.create(model="policy", max_tokens=64, messages=msgs)
    assert [b.text for b in m1.content] == [CONT] and m1.stop_reason == "end_turn"
    msgs = [msgs[0], {"role": "assistant", "content": PREFILL + m1.content[0].text}, {"role": "user", "content": "ok"}]
    m2 = await an.messages.create(model="policy", max_tokens=64, messages=msgs)
    assert m2.content[0].text == "Done."
    await _one_segment(app, http, pod, model, s["session_id"])


async def test_openai_continue_final_message_and_its_retry(gw, model):
    app, pod, queue, http = gw
    s = await _open(http)
    client = openai.AsyncOpenAI(base_url=s["openai_base_url"], api_key="EMPTY", http_client=http)
    queue[:] = [CONT + "<|im_end|>", "Done.<|im_end|>"]
    msgs = [{"role": "user", "content": "JSON please"}, {"role": "assistant", "content": PREFILL}]
    r1 = await client.chat.completions.create(model="policy", messages=msgs, extra_body=OPEN)
    assert r1.choices[0].message.content == CONT and r1.choices[0].finish_reason == "stop"
    again = await client.chat.completions.create(
        model="policy", messages=msgs, extra_body=OPEN, extra_headers={"x-stainless-retry-count": "1"}
    )
    assert again.choices[0].message.content == CONT and len(pod.calls) == 1  # the identical retry: cached
    msgs = [msgs[0], {"role": "assistant", "content": PREFILL + CONT}, {"role": "user", "content": "ok"}]
    r2 = await client.chat.completions.create(model="policy", messages=msgs)
    assert r2.choices[0].message.content == "Done."
    await _one_segment(app, http, pod, model, s["session_id"])


async def test_a_prefill_turn_later_in_a_session_extends_it(gw, model):
    app, pod, queue, http = gw
    s = await _open(http)
    client = openai.AsyncOpenAI(base_url=s["openai_base_url"], api_key="EMPTY", http_client=http)
    queue[:] = ["Hi.<|im_end|>", CONT + "<|im_end|>"]
    msgs = [{"role": "user", "content": "hello"}]
    r1 = await client.chat.completions.create(model="policy", messages=msgs)
    msgs += [{"role": "assistant", "content": r1.choices[0].message.content}, {"role": "user", "content": "JSON"}]
    r2 = await client.chat.completions.create(
        model="policy", messages=[*msgs, {"role": "assistant", "content": PREFILL}], extra_body=OPEN
    )
    assert r2.choices[0].message.content == CONT
    (p1, _), (p2, _) = pod.calls
    assert p2[: len(p1)] == p1 and model.decode(p2, skip_special=False).endswith(
        "JSON<|im_end|>\n<|im_start|>assistant\n" + PREFILL
    )
    assert (await http.get(f"/v1/sessions/{s['session_id']}")).json()["segments"] == 1


async def test_streamed_prefill_sends_only_the_continuation(gw, model):
    app, pod, queue, http = gw
    msgs = [{"role": "user", "content": "JSON please"}, {"role": "assistant", "content": PREFILL}]
    queue[:] = [CONT + "<|im_end|>", CONT + "<|im_end|>"]
    s = await _open(http)
    client = openai.AsyncOpenAI(base_url=s["openai_base_url"], api_key="EMPTY", http_client=http)
    stream = await client.chat.completions.create(model="policy", messages=msgs, stream=True, extra_body=OPEN)
    assert "".join([c.choices[0].delta.content or "" async for c in stream if c.choices]) == CONT
    s2 = await _open(http)
    an = anthropic.AsyncAnthropic(base_url=s2["anthropic_base_url"], api_key="EMPTY", http_client=http.anthropic)
    async with an.messages.stream(model="policy", max_tokens=64, messages=msgs) as st:
        assert "".join([t async for t in st.text_stream]) == CONT
    for prompt, _ in pod.calls:
        assert model.decode(prompt, skip_special=False).endswith("<|im_start|>assistant\n" + PREFILL)


async def test_first_turn_cache_keeps_closed_and_open_renders_apart(gw, model):
    """The same messages asked closed (a new reply after the assistant's) and open (a prefill) share the request
    key: the first-turn prompt cache must not hand one the other's render."""
    app, pod, queue, http = gw
    msgs = [{"role": "user", "content": "JSON please"}, {"role": "assistant", "content": PREFILL}]
    for body in ({}, OPEN, {}):
        s = await _open(http)
        r = await http.post(f"/s/{s['session_id']}/v1/chat/completions", json={"messages": msgs, **body})
        assert r.status_code == 200, r.text
    closed, opened, closed_again = (model.decode(p, skip_special=False) for p, _ in pod.calls)
    assert closed == closed_again and closed.endswith(PREFILL + "<|im_end|>\n<|im_start|>assistant\n")
    assert opened.endswith("<|im_start|>assistant\n" + PREFILL)


async def test_session_less_prefill(gw, model):
    app, pod, queue, http = gw
    msgs = [{"role": "user", "content": "JSON please"}, {"role": "assistant", "content": PREFILL}]
    queue[:] = [CONT + "<|im_end|>"]
    r = await http.post("/v1/chat/completions", json={"messages": msgs, **OPEN})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == CONT
    r = await http.post("/v1/chat/completions", json={"messages": msgs[:1], "add_generation_prompt": False})
    assert r.status_code == 200, r.text  # as vLLM: rendered without the generation prompt
    opened, bare = (model.decode(p, skip_special=False) for p, _ in pod.calls)
    assert opened.endswith("<|im_start|>assistant\n" + PREFILL) and bare.endswith("JSON please<|im_end|>\n")


USER = [{"role": "user", "content": "hi"}]
ASSISTANT = [*USER, {"role": "assistant", "content": PREFILL}]
FN = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(
    "body, param",
    [
        ({"messages": ASSISTANT, "continue_final_message": True}, "continue_final_message"),
        ({"messages": ASSISTANT, **OPEN, "add_generation_prompt": True}, "continue_final_message"),
        ({"messages": USER, **OPEN}, "continue_final_message"),
        ({"messages": USER, "add_generation_prompt": False}, "add_generation_prompt"),
        ({"messages": ASSISTANT, **OPEN, "tools": [FN], "tool_choice": "required"}, "tool_choice"),
        ({"messages": ASSISTANT, **OPEN, "response_format": {"type": "json_object"}}, "response_format"),
    ],
    ids=["default-generation-prompt", "both-true", "final-user", "no-prompt-on-session", "tool-choice", "json"],
)
async def test_openai_refusals_name_the_parameter(gw, body, param):
    app, pod, queue, http = gw
    s = await _open(http)
    r = await http.post(f"/s/{s['session_id']}/v1/chat/completions", json=body)
    err = r.json()["error"]
    assert r.status_code == 400 and (err["param"], err["code"]) == (param, "invalid_request"), r.text
    assert not pod.calls


@pytest.mark.parametrize(
    "extra, last, param",
    [
        ({}, [{"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}], "messages"),
        (
            {"tools": [{"name": "f", "input_schema": {"type": "object"}}], "tool_choice": {"type": "any"}},
            PREFILL,
            "tool_choice",
        ),
    ],
    ids=["tool-use", "tool-choice"],
)
async def test_anthropic_refusals_name_the_field(gw, extra, last, param):
    app, pod, queue, http = gw
    s = await _open(http)
    body = {"max_tokens": 8, "messages": [*USER, {"role": "assistant", "content": last}], **extra}
    r = await http.post(f"/s/{s['session_id']}/v1/messages", json=body)
    assert r.status_code == 400 and r.json()["error"]["message"].find(param) >= 0, r.text
    assert not pod.calls
