"""Reasoning split: with a template that has think blocks, a reply's <think>...</think> comes back as
``reasoning_content`` (OpenAI) or a ``thinking`` block (Anthropic), and the capture stays token-exact whether
the client sends it back or drops it (in-process app, fake pods, the real SDKs)."""

from __future__ import annotations

import shutil

import anthropic
import httpx2
import openai
import pytest

from services.gateway.chat import ChatModel
from tests.gateway_testlib import queued_gateway

PODS = ["http://pod-a:1"]
THINK = "<think>\nThe user wants a number.\n</think>\n\nFour.<|im_end|>"


@pytest.fixture(scope="module")
def model(tiny_qwen3, tmp_path_factory) -> ChatModel:
    """tiny_qwen3 with a template that renders an assistant's reasoning_content as a think block (as Qwen3's)."""
    path = tmp_path_factory.mktemp("thinking") / "model"
    shutil.copytree(tiny_qwen3, path)
    tpl = (path / "chat_template.jinja").read_text()
    old = "'<|im_start|>assistant' + nl + (message.content or '')"
    assert old in tpl
    (path / "chat_template.jinja").write_text(
        tpl.replace(
            old,
            (
                "'<|im_start|>assistant' + nl + ('<think>' + nl + message.reasoning_content + nl + '</think>' "
                "+ nl + nl "
                "if message.reasoning_content else '') + (message.content or '')"
            ),
        )
    )
    m = ChatModel(path)
    assert m.thinks
    return m


@pytest.fixture
def gw(model):
    return queued_gateway(model, PODS)


async def _exact(app, http, pods, model, sid: str) -> None:
    """One segment: the pod's tokens of both turns, the template's newline after the first <|im_end|>."""
    assert (await http.post(f"/v1/sessions/{sid}/finish", json={"reward": 1.0})).json()["segments"] == 1
    [d] = [x for x in await app.gateway.queue.read("t", 10, block_s=0) if x.trajectory.trajectory_id == sid]
    [seg] = d.trajectory.segments
    ids = seg.token_ids.tolist()
    (s1, e1), (s2, e2) = seg.action_spans.tolist()
    assert (
        ids[s1:e1] == model.encode(THINK)
        and ids == [c for p in pods.pods.values() for c in p.calls][-1][0] + ids[s2:e2]
    )
    assert model.decode(ids[e1 - 1 : e1 + 1], skip_special=False) == "<|im_end|>\n"


@pytest.mark.parametrize("send_back", [True, False])
async def test_openai_reasoning_content_and_exact_capture(gw, model, send_back):
    app, pods, queue, http = gw
    s = (await http.post("/v1/sessions", json={})).json()
    client = openai.AsyncOpenAI(base_url=s["openai_base_url"], api_key="EMPTY", http_client=http)
    queue.extend([THINK, "Six.<|im_end|>"])
    msgs = [{"role": "user", "content": "2 + 2?"}]
    r = await client.chat.completions.create(model="policy", messages=msgs)
    msg = r.choices[0].message.model_dump(exclude_none=True)
    assert msg["content"] == "Four." and msg["reasoning_content"] == "The user wants a number."
    if not send_back:
        msg.pop("reasoning_content")
    await client.chat.completions.create(model="policy", messages=msgs + [msg, {"role": "user", "content": "3+3?"}])
    await _exact(app, http, pods, model, s["session_id"])


async def test_openai_stream_sends_the_reasoning_apart(gw, model):
    _app, _pods, queue, http = gw
    s = (await http.post("/v1/sessions", json={})).json()
    client = openai.AsyncOpenAI(base_url=s["openai_base_url"], api_key="EMPTY", http_client=http)
    queue.append(THINK)
    chunks = [
        c
        async for c in await client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "2 + 2?"}], stream=True
        )
    ]
    deltas = [c.choices[0].delta.model_dump() for c in chunks if c.choices]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "The user wants a number."
    assert "".join(d.get("content") or "" for d in deltas) == "Four."


@pytest.mark.parametrize("send_back", [True, False])
async def test_anthropic_thinking_block_and_exact_capture(gw, model, send_back):
    app, pods, queue, http = gw
    s = (await http.post("/v1/sessions", json={})).json()
    an = anthropic.AsyncAnthropic(
        base_url=s["anthropic_base_url"],
        api_key="EMPTY",
        http_client=httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://gw"),
    )
    queue.extend([THINK, "Six.<|im_end|>"])
    msgs = [{"role": "user", "content": "2 + 2?"}]
    m = await an.messages.create(model="policy", max_tokens=64, messages=msgs)
    assert [b.type for b in m.content] == ["thinking", "text"] and m.content[0].thinking == "The user wants a number."
    blocks = [b.model_dump(exclude_none=True) for b in m.content if send_back or b.type == "text"]
    async with an.messages.stream(
        model="policy",
        max_tokens=64,
        messages=msgs + [{"role": "assistant", "content": blocks}, {"role": "user", "content": "3 + 3?"}],
    ) as st:
        final = await st.get_final_message()
    assert final.content[-1].text == "Six."
    await _exact(app, http, pods, model, s["session_id"])


async def test_anthropic_stream_starts_with_the_thinking_block(gw, model):
    app, _pods, queue, http = gw
    s = (await http.post("/v1/sessions", json={})).json()
    an = anthropic.AsyncAnthropic(
        base_url=s["anthropic_base_url"],
        api_key="EMPTY",
        http_client=httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://gw"),
    )
    queue.append(THINK)
    async with an.messages.stream(model="policy", max_tokens=64, messages=[{"role": "user", "content": "2+2?"}]) as st:
        final = await st.get_final_message()
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in final.content] == [
        ("thinking", "The user wants a number."),
        ("text", "Four."),
    ]


@pytest.mark.parametrize("stop", [None, ["number"]])
async def test_text_feed_streams_the_think_block_apart_from_the_text(model, stop):
    """The block's text as it comes (never its tags, the whitespace the final reasoning strips, or a stop string:
    the turn's result ends there), then the text once the block has closed."""
    from services.gateway.streaming import TextFeed
    from services.gateway.thinking import split_reasoning

    feed = TextFeed(model, stop)
    parts = []
    for tok in model.encode(THINK):  # one engine step per token
        feed.ids.append(tok)
        parts += feed._safe()
    kinds = [kind for kind, _ in parts]
    assert kinds == sorted(kinds) and kinds.count("reasoning") >= 3  # all the reasoning first, in steps
    thought = "".join(p for kind, p in parts if kind == "reasoning")
    assert thought == split_reasoning(THINK[: THINK.index(stop[0])] if stop else THINK)[0]
    assert "".join(p for kind, p in parts if kind == "text") == ("" if stop else "Four.")
    assert feed.reasoning == ("" if stop else "The user wants a number.")
    assert all("think" not in p and not p.endswith((" ", "\n")) for _, p in parts)


async def test_a_raw_session_keeps_the_think_block_in_the_text_on_every_wire(gw, model):
    """replies "raw" (Molt's chat server, for its ChatAgents): the reply text as generated, streamed or not;
    Molt's agents read ``msg.content[0].text`` and grade what they find in it."""
    app, _pods, queue, http = gw
    text = THINK.removesuffix("<|im_end|>")
    s = (await http.post("/v1/sessions", json={"replies": "raw"})).json()
    client = openai.AsyncOpenAI(base_url=s["openai_base_url"], api_key="EMPTY", http_client=http)
    queue.extend([THINK, THINK, THINK])
    msgs = [{"role": "user", "content": "2 + 2?"}]
    msg = (await client.chat.completions.create(model="policy", messages=msgs)).choices[0].message
    assert msg.content == text and not getattr(msg, "reasoning_content", None)
    again = [{"role": "user", "content": "3 + 3?"}]  # not the same request: not answered from the last turn
    stream = await client.chat.completions.create(model="policy", messages=again, stream=True)
    assert "".join([c.choices[0].delta.content or "" async for c in stream if c.choices]) == text
    an = anthropic.AsyncAnthropic(
        base_url=s["anthropic_base_url"],
        api_key="EMPTY",
        http_client=httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://gw"),
    )
    m = await an.messages.create(model="policy", max_tokens=64, messages=[{"role": "user", "content": "4 + 4?"}])
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == text
    bad = await http.post("/v1/sessions", json={"replies": "structured"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "replies"
