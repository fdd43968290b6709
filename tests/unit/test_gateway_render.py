"""``POST /v1/sessions/{id}/render``: an Env's chat prompt as text, rendered as the first turn's ``messages`` would
be (in-process app, fake pods)."""

from __future__ import annotations

import pytest

from services.gateway.chat import ChatModel
from tests.gateway_testlib import scripted_gateway

PODS = ["http://pod-a:1"]


@pytest.fixture(scope="module")
def model(tiny_qwen3) -> ChatModel:
    return ChatModel(tiny_qwen3)


@pytest.fixture
def env(model):
    def make():
        app, pods, http = scripted_gateway(model, lambda prompt, sp: model.encode("Hello world.<|im_end|>"), PODS)
        return app, pods, None, http

    return make


async def _open(http) -> dict:
    r = await http.post("/v1/sessions", json={})
    assert r.status_code == 201, r.text
    return r.json()


async def _written(app) -> list:
    return [d.trajectory for d in await app.gateway.queue.read("t", 100, block_s=0)]


async def test_render_gives_the_first_turns_text_which_sent_back_as_text_records_the_same_tokens(env, model):
    """An Env sees its chat prompt rendered (as Molt's dataset renders it for a step runner) and sends the text back
    as its first turn: the same tokens as sending the messages. Tools go into the template; nothing is recorded."""
    app, pods, replies, http = env()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    tools = [{"type": "function", "function": {"name": "look", "description": "Look around.", "parameters": {}}}]
    a, b = (await _open(http))["session_id"], (await _open(http))["session_id"]
    r = await http.post(f"/v1/sessions/{a}/render", json={"messages": messages})
    assert r.status_code == 200, r.text
    text = r.json()["text"]
    assert text == model.render(messages, None, generation_prompt=True) and r.json()["num_tokens"] == len(
        model.encode(text)
    )
    with_tools = (await http.post(f"/v1/sessions/{a}/render", json={"messages": messages, "tools": tools})).json()
    assert '"name": "look"' in with_tools["text"] and with_tools["text"] != text
    assert (await http.get(f"/v1/sessions/{a}")).json()["turns"] == 0
    sp = {"max_tokens": 2}
    by_text = (await http.post(f"/v1/sessions/{a}/generate", json={"append_text": text, "sampling_params": sp})).json()
    by_msgs = await http.post(f"/v1/sessions/{b}/generate", json={"messages": messages, "sampling_params": sp})
    by_msgs = by_msgs.json()
    assert by_text["num_tokens"] == by_msgs["num_tokens"]
    for sid in (a, b):
        await http.post(f"/v1/sessions/{sid}/finish", json={"reward": 1})
    first, second = await _written(app)
    assert list(first.segments[0].token_ids) == list(second.segments[0].token_ids)
    # bad input is a 400 naming the field; a finished session a 409
    sid = (await _open(http))["session_id"]
    r = await http.post(f"/v1/sessions/{sid}/render", json={"messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = await http.post(f"/v1/sessions/{sid}/render", json={"messages": messages, "tools": [{"type": "web"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
    r = await http.post(f"/v1/sessions/{a}/render", json={"messages": messages})
    assert r.status_code == 409, r.text
