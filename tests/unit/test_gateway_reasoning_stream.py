"""Reasoning as the pod generates it, on every wire, and with a generation prompt that opens the think block
itself (Qwen3-Thinking-2507's, DeepSeek-R1 distills', QwQ's: the reply holds only ``...</think>\\n\\nanswer``).
Streamed, the think block's text goes out in deltas while it is generated (chat ``reasoning_content``, Anthropic
``thinking_delta``, Responses ``reasoning_text.delta``) and what the real SDKs assemble is the reply the same turn
gets unstreamed; the captured tokens are the pod's whatever the split (in-process app, fake pods)."""

from __future__ import annotations

import anthropic
import openai
import pytest

from services.gateway.chat import ChatModel
from services.gateway.streaming import TextFeed
from services.gateway.thinking import split_reasoning, think_opened
from tests.gateway_testlib import queued_gateway, stream_steps, thinking_model, thinking_switch_model

PODS = ["http://pod-a:1"]
THOUGHT = "Two and two make four, so the user wants to read the number four."
BLOCK = f"{THOUGHT}\n</think>\n\nFour, as two plus two is four.<|im_end|>"
LIMIT = 12  # a length stop inside the think block


@pytest.fixture(scope="module", params=["tagged", "opened"])
def model(request, tiny_qwen3, tmp_path_factory) -> ChatModel:
    """The reply opens its think block itself (Qwen3's: "tagged") or the generation prompt did ("opened")."""
    m = thinking_model(tiny_qwen3, tmp_path_factory.mktemp(request.param) / "model", request.param == "opened")
    assert m.thinks
    return m


def _opens(model: ChatModel) -> bool:
    return model.render([{"role": "user", "content": "hi"}], None, True).endswith("<think>\n")


def _reply(model: ChatModel) -> str:
    """The pod's reply to a question: the block's end only when the prompt opened it."""
    return BLOCK if _opens(model) else "<think>\n" + BLOCK


@pytest.fixture
def gw(model):
    app, pods, queue, http = queued_gateway(model, PODS)
    stream_steps(app, pods)
    return app, pods, queue, http


async def _session(http) -> dict:
    return (await http.post("/v1/sessions", json={})).json()


def _anthropic(http, s: dict) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=s["anthropic_base_url"], api_key="EMPTY", http_client=http.anthropic)


def test_the_rendered_prompt_says_whether_it_opened_the_block(model, tiny_qwen3, tmp_path_factory):
    ask = [{"role": "user", "content": "What does <think> do?"}]
    assert think_opened(model.render(ask, None, True)) == _opens(model)
    off = thinking_switch_model(tiny_qwen3, tmp_path_factory.mktemp("switch") / "model")
    closed = off.with_kwargs({"enable_thinking": False}).render(ask, None, True)
    assert closed.endswith("<think>\n\n</think>\n\n") and not think_opened(closed)
    # a prefill continues the assistant's text: an unclosed block in it is open
    assert think_opened("<|im_start|>assistant\n<think>\nLet me", prefill="<think>\nLet me")
    assert not think_opened("<|im_start|>assistant\n<think>\nx</think>\n\nIt", prefill="<think>\nx</think>\n\nIt")


@pytest.mark.parametrize("opened", [False, True])
def test_split_reasoning_reads_the_block_the_prompt_opened(opened):
    """As vLLM's think parsers: once the prompt opened the block, the reply up to ``</think>`` is reasoning, and
    all of it when the block never closes (a length stop); otherwise only a block the reply opens is."""
    assert split_reasoning(BLOCK, opened) == ((THOUGHT, BLOCK.split("\n\n", 1)[1]) if opened else ("", BLOCK))
    assert split_reasoning(THOUGHT + " And", opened) == ((THOUGHT + " And", "") if opened else ("", THOUGHT + " And"))
    assert split_reasoning("<think>\n" + BLOCK, opened) == (THOUGHT, BLOCK.split("\n\n", 1)[1])


async def test_the_text_feed_streams_the_block_the_prompt_opened(model):
    opened = _opens(model)
    feed = TextFeed(model, None, opened=opened)
    parts = []
    for tok in model.encode(_reply(model)):  # one engine step per token
        feed.ids.append(tok)
        parts += feed._safe()
    kinds = [kind for kind, _ in parts]
    assert kinds == sorted(kinds) and kinds.count("reasoning") >= 3
    assert "".join(p for kind, p in parts if kind == "reasoning") == feed.reasoning == THOUGHT
    assert "".join(p for kind, p in parts if kind == "text") == "Four, as two plus two is four."


@pytest.mark.parametrize("limit", [None, LIMIT])
async def test_chat_streams_reasoning_content_as_it_is_generated(gw, model, limit):
    _app, _pods, queue, http = gw
    client = openai.AsyncOpenAI(base_url=(await _session(http))["openai_base_url"], api_key="EMPTY", http_client=http)
    queue.extend([_reply(model)] * 2)
    args = {"model": "policy", "messages": [{"role": "user", "content": "2 + 2?"}], "max_tokens": limit or 64}
    plain = (await client.chat.completions.create(**args)).choices[0]
    cut = model.decode(model.encode(_reply(model))[:limit], skip_special=True).removeprefix("<think>").strip()
    assert plain.message.reasoning_content == (cut if limit else THOUGHT) and cut.startswith("Two and")
    assert plain.message.content == ("" if limit else "Four, as two plus two is four.")
    args["messages"] = [{"role": "user", "content": "2 + 2 ?"}]  # not a retry of the turn before
    chunks = [c async for c in await client.chat.completions.create(**args, stream=True) if c.choices]
    deltas = [c.choices[0].delta.model_dump() for c in chunks]
    thought = [i for i, d in enumerate(deltas) if d.get("reasoning_content")]
    text = [i for i, d in enumerate(deltas) if d.get("content")]
    assert len(thought) >= 3 and (not text or max(thought) < min(text))  # live, and all before the text
    assert "".join(deltas[i]["reasoning_content"] for i in thought) == plain.message.reasoning_content
    assert "".join(d.get("content") or "" for d in deltas) == plain.message.content
    assert chunks[-1].choices[0].finish_reason == plain.finish_reason == ("length" if limit else "stop")


@pytest.mark.parametrize("limit", [None, LIMIT])
async def test_anthropic_streams_the_thinking_block_as_it_is_generated(gw, model, limit):
    _app, _pods, queue, http = gw
    an = _anthropic(http, await _session(http))
    queue.extend([_reply(model)] * 2)
    args = {"model": "policy", "max_tokens": limit or 64, "messages": [{"role": "user", "content": "2 + 2?"}]}
    plain = await an.messages.create(**args)
    assert [b.type for b in plain.content] == ["thinking", "text"] and plain.content[0].thinking.startswith("Two")
    assert plain.content[1].text == ("" if limit else "Four, as two plus two is four.")
    args["messages"] = [{"role": "user", "content": "2 + 2 ?"}]
    async with an.messages.stream(**args) as st:
        events = [ev async for ev in st if ev.type.startswith("content_block")]
        final = await st.get_final_message()
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in plain.content]
    assert final.stop_reason == plain.stop_reason == ("max_tokens" if limit else "end_turn")
    shape = [(ev.type, ev.index, getattr(ev, "delta", ev).type) for ev in events if ev.type != "content_block_start"]
    thought = [s for s in shape if s[2] == "thinking_delta"]
    assert len(thought) >= 3 and set(thought) == {("content_block_delta", 0, "thinking_delta")}
    assert shape[: len(thought)] == thought  # all of the thinking first, as it comes
    text = [("content_block_delta", 1, "text_delta")] * (len(shape) - len(thought) - 3)
    stop = [("content_block_stop", 0, "content_block_stop"), ("content_block_stop", 1, "content_block_stop")]
    assert shape[len(thought) :] == [("content_block_delta", 0, "signature_delta"), stop[0], *text, stop[1]]
    assert [ev.content_block.type for ev in events if ev.type == "content_block_start"] == ["thinking", "text"]


@pytest.mark.parametrize("limit", [None, LIMIT])
async def test_responses_stream_the_reasoning_item_of_a_block_the_prompt_opened(gw, model, limit):
    _app, _pods, queue, http = gw
    client = openai.AsyncOpenAI(base_url=(await _session(http))["openai_base_url"], api_key="EMPTY", http_client=http)
    queue.extend([_reply(model)] * 2)
    args = {"model": "policy", "input": "2 + 2?", "max_output_tokens": limit or 64}
    plain = await client.responses.create(**args)
    assert [o.type for o in plain.output] == ["reasoning", "message"]
    assert plain.output[0].content[0].text.startswith("Two and")
    assert plain.output_text == ("" if limit else "Four, as two plus two is four.")
    args["input"] = "2 + 2 ?"
    async with client.responses.stream(**args) as st:
        events = [ev async for ev in st]
        final = events[-1].response if limit else await st.get_final_response()
    thought = [ev.delta for ev in events if ev.type == "response.reasoning_text.delta"]
    assert len(thought) >= 3 and "".join(thought) == plain.output[0].content[0].text
    shapes = [[(c.type, c.text) for c in o.content] for o in final.output]
    assert shapes == [[(c.type, c.text) for c in o.content] for o in plain.output]


async def test_a_session_less_reply_is_split_as_a_sessions(gw, model):
    """Without a session (nothing captured, the answer sent whole), each wire splits the reply the same way."""
    _app, _pods, queue, http = gw
    client = openai.AsyncOpenAI(base_url="http://gw/v1", api_key="EMPTY", http_client=http)
    an = anthropic.AsyncAnthropic(base_url="http://gw", api_key="EMPTY", http_client=http.anthropic)
    queue.extend([_reply(model)] * 3)
    ask = [{"role": "user", "content": "2 + 2?"}]
    r = (await client.chat.completions.create(model="policy", messages=ask, max_tokens=LIMIT)).choices[0].message
    assert r.reasoning_content.startswith("Two and") and r.content == ""
    m = await an.messages.create(model="policy", max_tokens=LIMIT, messages=ask)
    assert [(b.type, getattr(b, "thinking", None)) for b in m.content] == [
        ("thinking", r.reasoning_content),
        ("text", None),
    ]
    out = (await client.responses.create(model="policy", input="2 + 2?", max_output_tokens=LIMIT)).output
    assert [(o.type, o.content[0].text) for o in out] == [("reasoning", r.reasoning_content), ("message", "")]


@pytest.mark.parametrize("send_back", [True, False])
@pytest.mark.parametrize("limit", [None, LIMIT])
async def test_the_capture_is_the_pods_tokens_and_the_echoed_reply_extends_it(gw, model, send_back, limit):
    """The split is the client's view only: the segment holds the pod's tokens, and the reply the client sends
    back (its reasoning or not) is the same reply, so the next turn extends the segment."""
    app, pods, queue, http = gw
    s = await _session(http)
    client = openai.AsyncOpenAI(base_url=s["openai_base_url"], api_key="EMPTY", http_client=http)
    queue.extend([_reply(model), "Six.<|im_end|>"])
    msgs = [{"role": "user", "content": "2 + 2?"}]
    r = await client.chat.completions.create(model="policy", messages=msgs, max_tokens=limit or 64, stream=True)
    content, thought = "", ""
    async for c in r:
        if c.choices:
            content += c.choices[0].delta.content or ""
            thought += c.choices[0].delta.model_dump().get("reasoning_content") or ""
    msg = {"role": "assistant", "content": content, **({"reasoning_content": thought} if send_back else {})}
    await client.chat.completions.create(model="policy", messages=[*msgs, msg, {"role": "user", "content": "3+3?"}])
    assert (await http.post(f"/v1/sessions/{s['session_id']}/finish", json={"reward": 1.0})).json()["segments"] == 1
    [d] = await app.gateway.queue.read("t", 10, block_s=0)
    [seg] = d.trajectory.segments
    ids = seg.token_ids.tolist()
    (s1, e1), (s2, e2) = seg.action_spans.tolist()
    calls = pods.pods[PODS[0]].calls
    assert ids[:s1] == calls[0][0] and ids[s1:e1] == model.encode(_reply(model))[:limit]
    assert ids == calls[-1][0] + ids[s2:e2] and model.decode(ids[s2:e2], False) == "Six.<|im_end|>"
