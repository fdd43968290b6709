"""The gateway app's wires end to end in-process: real openai/anthropic SDKs over ASGI, fake pods, memory queue.
Sessions and their lifecycle (pod failure, keys, token turns, aborts) are test_gateway_app_sessions.py's."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest

from molt.config import expand_short_flags, parse_settings
from services.gateway.chat import ChatModel
from services.gateway.config import GatewaySettings
from tests.gateway_testlib import fake_logprob
from tests.unit.gateway_app_testlib import PODS, TOOLS, open_session, pod_calls, scripted_env, written


@pytest.fixture
def model(chat_model) -> ChatModel:
    return chat_model


@pytest.fixture
def env(chat_model):
    return scripted_env(chat_model)


async def test_openai_tool_call_turns_are_captured_token_exact(env, model):
    app, pods, replies, http = env()
    s = await open_session(http, group_id="g1", sample_index=2, env_name="weather", env_version="1")
    client = openai.AsyncOpenAI(base_url=s["openai_base_url"], api_key="EMPTY", http_client=http)
    replies.queue = [
        '<tool_call>{"name": "get_weather", "arguments": {"city": "paris"}}</tool_call><|im_end|>',
        "It is sunny.<|im_end|>",
    ]
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    r1 = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
    call = r1.choices[0].message.tool_calls[0]
    assert r1.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "paris"}
    messages += [
        r1.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21C"},
    ]
    raw = await client.chat.completions.with_raw_response.create(model="policy", messages=messages, tools=TOOLS)
    assert raw.headers["x-molt-policy-version"] == "0"
    r2 = raw.parse()
    assert r2.choices[0].message.content == "It is sunny." and r2.usage.completion_tokens > 0
    done = (await http.post(f"/v1/sessions/{s['session_id']}/finish", json={"reward": 1.0, "info": {"x": 2}})).json()
    assert done["written"] and done["trajectory_id"] == s["session_id"]
    [traj] = await written(app)
    assert (traj.group_id, traj.sample_index, traj.reward, traj.info) == ("g1", 2, 1.0, {"x": 2.0})
    assert traj.provenance.env_name == "weather" and traj.provenance.chat_template_hash == model.chat_template_hash
    [seg] = traj.segments
    (p1, _), (p2, _) = pod_calls(pods)
    g1 = model.encode('<tool_call>{"name": "get_weather", "arguments": {"city": "paris"}}</tool_call><|im_end|>')
    g2 = model.encode("It is sunny.<|im_end|>")
    assert p2[: len(p1)] == p1 and p2[len(p1) : len(p1) + len(g1)] == g1  # second prompt extends the first exactly
    assert seg.token_ids.tolist() == p2 + g2
    assert seg.action_spans.tolist() == [[len(p1), len(p1) + len(g1)], [len(p2), len(p2) + len(g2)]]
    assert seg.logprobs.tolist() == pytest.approx(
        [fake_logprob(t, i) for i, t in enumerate(g1)] + [fake_logprob(t, i) for i, t in enumerate(g2)]
    )
    assert "sunny, 21C" in model.decode(p2[len(p1) + len(g1) :], skip_special=False)
    # finishing twice is idempotent; the session is closed for further turns
    again = (await http.post(f"/v1/sessions/{s['session_id']}/finish", json={"reward": 0.0})).json()
    assert again["entry_id"] == done["entry_id"] and len(await written(app)) == 0
    with pytest.raises(openai.ConflictError):
        await client.chat.completions.create(model="policy", messages=messages)


async def test_openai_stream_and_anthropic_wire(env, model):
    app, pods, replies, http = env()
    s = await open_session(http)
    oa = openai.AsyncOpenAI(base_url=s["openai_base_url"], api_key="EMPTY", http_client=http)
    replies.queue = ["Streaming works fine.<|im_end|>"]
    stream = await oa.chat.completions.create(
        model="policy",
        messages=[{"role": "user", "content": "go"}],
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [c async for c in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Streaming works fine." and chunks[-1].usage.completion_tokens > 0
    # Anthropic on a second session: tool_use out, tool_result in, streamed
    s2 = await open_session(http)
    an = anthropic.AsyncAnthropic(base_url=s2["anthropic_base_url"], api_key="EMPTY", http_client=http.anthropic)
    replies.queue = [
        '<tool_call>{"name": "get_weather", "arguments": {"city": "rome"}}</tool_call><|im_end|>',
        "Rome is warm.<|im_end|>",
    ]
    tools = [{"name": "get_weather", "description": "w", "input_schema": {"type": "object"}}]
    msgs = [{"role": "user", "content": "Weather in Rome?"}]
    m1 = await an.messages.create(model="policy", max_tokens=64, system="Be brief.", messages=msgs, tools=tools)
    assert m1.stop_reason == "tool_use" and m1.content[-1].input == {"city": "rome"}
    msgs += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m1.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": m1.content[-1].id, "content": "warm"}]},
    ]
    async with an.messages.stream(model="policy", max_tokens=64, system="Be brief.", messages=msgs, tools=tools) as st:
        final = await st.get_final_message()
    assert final.content[0].text == "Rome is warm." and final.stop_reason == "end_turn"
    summary = (await http.get(f"/v1/sessions/{s2['session_id']}")).json()
    assert summary["segments"] == 1 and summary["turns"] == 2


async def test_errors_have_each_wires_shape(env):
    app, pods, replies, http = env(session={"max_length": 64})
    s = await open_session(http)
    sid = s["session_id"]
    r = await http.post(f"/s/{sid}/v1/chat/completions", content=b"{not json")
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = await http.post(f"/s/{sid}/v1/chat/completions", json={"messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = await http.post("/s/nope/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found"
    r = await http.post("/s/nope/v1/messages", json={"max_tokens": 5, "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 404 and r.json() == {
        "type": "error",
        "error": {"type": "not_found_error", "message": r.json()["error"]["message"]},
    }
    r = await http.post(f"/s/{sid}/v1/messages", json={"messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = await http.post(
        f"/s/{sid}/v1/chat/completions", json={"messages": [{"role": "user", "content": "word " * 100}]}
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = await http.post(f"/s/{sid}/v1/chat/completions", json={"messages": [{"role": "robot", "content": "x"}]})
    assert r.status_code == 400
    r = await http.post(f"/v1/sessions/{sid}/finish", json={"reward": "high"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "reward"
    # nothing generated: finishing writes nothing and says so
    r = await http.post(f"/v1/sessions/{sid}/finish", json={"reward": 1})
    assert r.json()["written"] is False and await written(app) == []
    r = await http.delete(f"/v1/sessions/{sid}")
    assert r.status_code == 409
    r = await http.get("/nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    # a base URL joined the wrong way (dspy posts to {anthropic base}/messages): the 404 names the bases
    r = await http.post(f"/s/{sid}/messages", json={"max_tokens": 5, "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 404 and "its Anthropic base URL /s/{id} (the SDK adds /v1/messages)" in r.text
    r = await http.get(f"/s/{sid}/v1/messages")  # routing errors too come in the path's wire shape
    assert (
        r.status_code == 405 and r.headers["allow"] == "POST" and r.json()["error"]["type"] == "invalid_request_error"
    )
    assert r.json()["type"] == "error"


async def test_routing_errors_come_in_the_paths_wire_shape(env):
    app, _, _, http = env()
    sid = (await open_session(http))["session_id"]
    body = {"messages": [{"role": "user", "content": "x"}]}
    r = await http.post("/s//v1/chat/completions", json=body)  # no id: no route at all
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = await http.put(f"/s/{sid}/v1/chat/completions", json=body)
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    r = await http.post(f"/s/{sid}/v1/chat", json=body)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = await http.post(f"/s/{sid}/v1/messages/count_tokens", json={"messages": body["messages"]})
    assert r.status_code == 200 and r.json()["input_tokens"] > 0


async def test_oversized_bodies_are_refused_before_they_are_held(env):
    app, pods, replies, http = env(session={"max_body_bytes": 2000})
    sid = (await open_session(http))["session_id"]
    big = json.dumps({"messages": [{"role": "user", "content": "x" * 3000}]}).encode()
    r = await http.post(f"/s/{sid}/v1/chat/completions", content=big)  # Content-Length says so at once
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert r.headers["connection"] == "close"

    async def chunks(n: int):  # no Content-Length: refused once the chunks read pass the limit
        for _ in range(n):
            yield b" " * 500
        yield b'{"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}'

    r = await http.anthropic.post(f"/s/{sid}/v1/messages", content=chunks(10))
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
    r = await http.anthropic.post(f"/s/{sid}/v1/messages", content=chunks(2))  # under it: read whole, served
    assert r.status_code == 200 and r.json()["type"] == "message"


async def test_a_client_gone_before_its_body_arrived_gets_nothing_and_logs_nothing(env, caplog):
    app, pods, replies, http = env()
    sid = (await open_session(http))["session_id"]
    sent = []

    async def receive():
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": f"/s/{sid}/v1/chat/completions",
        "raw_path": b"",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json")],
        "scheme": "http",
        "server": ("gw", 80),
        "client": ("127.0.0.1", 1),
        "http_version": "1.1",
    }
    await app(scope, receive, send)
    assert sent == [] and not [r for r in caplog.records if r.levelname == "ERROR"]
    assert pods.pods[PODS[0]].calls == []  # nothing was generated for it


async def test_unexpected_error_is_a_500_in_the_wire_shape(env):
    app, pods, replies, http = env()
    s = await open_session(http)

    def broken(prompt, sp):
        raise RuntimeError("pod script exploded")

    for pod in pods.pods.values():
        pod.script = broken
    r = await http.post(
        f"/s/{s['session_id']}/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}
    )
    assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error"
    assert "pod script exploded" in r.json()["error"]["message"]
    r = await http.post(
        f"/s/{s['session_id']}/v1/messages", json={"max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}
    )
    assert r.status_code == 500 and r.json()["type"] == "error" and r.json()["error"]["type"] == "api_error"
    # the session is still usable once the pod behaves
    for pod in pods.pods.values():
        pod.script = replies
    r = await http.post(
        f"/s/{s['session_id']}/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}
    )
    assert r.status_code == 200


async def test_sessionless_wires_and_models(env):
    app, pods, replies, http = env()
    oa = openai.AsyncOpenAI(base_url="http://gw/v1", api_key="EMPTY", http_client=http)
    r = await oa.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": "x"}], n=2, logprobs=True
    )
    assert len(r.choices) == 2 and len(r.choices[0].logprobs.content) == len(r.choices[0].logprobs.content)
    c = await oa.completions.create(model="policy", prompt="Once", max_tokens=3)
    assert c.choices[0].finish_reason == "length"
    assert [m.id for m in (await oa.models.list()).data] == ["policy"]
    assert (await oa.models.retrieve("policy")).id == "policy"
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        await oa.models.retrieve("other/model")
    s = await open_session(http)
    on_session = openai.AsyncOpenAI(base_url=s["openai_base_url"], api_key="EMPTY", http_client=http)
    assert (await on_session.models.retrieve("policy")).id == "policy"
    assert (await http.get("/readyz")).status_code == 200


def test_cli_short_flags_and_loopback_rule():
    argv = expand_short_flags(["--model", "/m", "--port=9", "--rollout.urls", "http://a:1,http://b:2"])
    s = parse_settings(GatewaySettings, argv, environ={"MOLT_AUTH__API_KEYS": "x,y"})
    assert (s.model.path, s.server.port, s.rollout.urls, s.auth.api_keys) == (
        "/m",
        9,
        ["http://a:1", "http://b:2"],
        ["x", "y"],
    )
    with pytest.raises(ValueError, match="without API keys"):
        GatewaySettings.model_validate({"server": {"host": "0.0.0.0"}})
    GatewaySettings.model_validate({"server": {"host": "0.0.0.0"}, "auth": {"api_keys": ["k"]}})


async def test_streamed_completions_carry_logprobs_and_usage_and_chat_refuses_what_it_cannot_stream(env):
    import json

    _, _, replies, http = env()
    replies.queue = ["Hello world.", "Hello again."]
    body = {"model": "policy", "prompt": "Once", "max_tokens": 4, "n": 2, "logprobs": 2, "stream": True}
    r = await http.post("/v1/completions", json={**body, "stream_options": {"include_usage": True}})
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    firsts = {i: next(e for e in events if e["choices"] and e["choices"][0]["index"] == i) for i in (0, 1)}
    for first in firsts.values():
        lp = first["choices"][0]["logprobs"]
        assert lp["tokens"] and len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"])
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] > 0
    assert not any("usage" in e for e in events[:-1]) and r.text.endswith("data: [DONE]\n\n")
    r = await http.post("/v1/completions", json={**body, "stream_options": {"include_usage": "yes"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "include_usage", r.text
    chat = {"model": "policy", "messages": [{"role": "user", "content": "x"}], "n": 2, "stream": True}
    r = await http.post("/v1/chat/completions", json=chat)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
