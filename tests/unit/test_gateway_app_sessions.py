"""The gateway app's sessions end to end in-process: real openai/anthropic SDKs over ASGI, fake pods, memory
queue. A pod failure moves a session, keys isolate, token turns and stop strings act as vLLM's, a truncated episode
is marked so, an abort racing a finish is answered in order."""

from __future__ import annotations

import anthropic
import openai
import pytest

from services.gateway.chat import ChatModel
from tests.unit.gateway_app_testlib import PODS, open_session, pod_calls, scripted_env, written


@pytest.fixture
def model(chat_model) -> ChatModel:
    return chat_model


@pytest.fixture
def env(chat_model):
    return scripted_env(chat_model)


async def test_pod_failure_moves_session_and_records_switch(env):
    app, pods, replies, http = env()
    s = await open_session(http)
    sid = s["session_id"]
    client = openai.AsyncOpenAI(base_url=s["openai_base_url"], api_key="EMPTY", http_client=http, max_retries=0)
    msgs = [{"role": "user", "content": "hi"}]
    r1 = await client.chat.completions.create(model="policy", messages=msgs)
    first = (await http.get(f"/v1/sessions/{sid}")).json()["pod"]
    pods.pods[first].down = True
    msgs += [r1.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "again"}]
    await client.chat.completions.create(model="policy", messages=msgs)
    summary = (await http.get(f"/v1/sessions/{sid}")).json()
    other = [u for u in PODS if u != first][0]
    assert summary["pod"] == other and summary["segments"] == 1
    start, event = summary["events"]
    assert (start["kind"], start["pod"]) == ("pod", first)
    assert event["kind"] == "pod_switch" and (event["from"], event["to"]) == (first, other)
    # the other pod got the exact prefix the first one had built
    assert pods.pods[other].calls[0][0][: len(pods.pods[first].calls[0][0])] == pods.pods[first].calls[0][0]
    await http.post(f"/v1/sessions/{sid}/finish", json={"reward": 0.5})
    [traj] = await written(app)
    assert [e["kind"] for e in traj.events] == ["pod", "pod_switch"]
    # all pods down: a clean 503, streamed or not (a stream's headers wait for its first token)
    pods.pods[other].down = True
    s2 = await open_session(http)
    c2 = openai.AsyncOpenAI(base_url=s2["openai_base_url"], api_key="EMPTY", http_client=http, max_retries=0)
    for stream in (False, True):
        with pytest.raises(openai.APIStatusError, match="no healthy rollout pod") as err:
            await c2.chat.completions.create(
                model="policy", messages=[{"role": "user", "content": "x"}], stream=stream
            )
        assert err.value.status_code == 503
    an = anthropic.AsyncAnthropic(
        base_url=s2["anthropic_base_url"], api_key="EMPTY", http_client=http.anthropic, max_retries=0
    )
    with pytest.raises(anthropic.APIStatusError, match="no healthy rollout pod"):
        async with an.messages.stream(model="policy", max_tokens=4, messages=[{"role": "user", "content": "z"}]) as st:
            await st.get_final_message()


async def test_context_full_length_answers_a_turn_that_does_not_fit_with_an_empty_length_reply(env):
    """``context_full: "length"`` (how env workers open ChatAgent sessions): a turn past max_length is a 200 with no
    tokens and finish_reason "length" on every wire, nothing recorded; a value it does not know is a 400."""
    app, pods, replies, http = env(session={"max_length": 64})
    r = await http.post("/v1/sessions", json={"context_full": "truncate"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "context_full"
    sid = (await open_session(http, context_full="length"))["session_id"]
    long = [{"role": "user", "content": "word " * 100}]
    r = await http.post(f"/s/{sid}/v1/chat/completions", json={"messages": long})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length" and not choice["message"]["content"]
    r = await http.post(f"/s/{sid}/v1/messages", json={"max_tokens": 5, "messages": long})
    assert r.status_code == 200 and r.json()["stop_reason"] == "max_tokens", r.text
    assert not "".join(block.get("text", "") for block in r.json()["content"])
    summary = (await http.get(f"/v1/sessions/{sid}")).json()
    assert summary["turns"] == 0 and summary["num_tokens"] == 0


async def test_api_keys_isolation_and_limits(env):
    app, pods, replies, http = env(auth={"api_keys": ["k1", "k2"], "max_open_sessions_per_key": 1})
    assert (await http.post("/v1/sessions", json={})).status_code == 401
    assert (await http.post("/v1/sessions", json={}, headers={"authorization": "Bearer bad"})).status_code == 401
    s = await open_session(http, headers={"authorization": "Bearer k1"})
    r = await http.post("/v1/sessions", json={}, headers={"authorization": "Bearer k1"})
    assert r.status_code == 429 and r.headers["retry-after"] == "5"
    other = await http.get(f"/v1/sessions/{s['session_id']}", headers={"x-api-key": "k2"})
    assert other.status_code == 404
    an = anthropic.AsyncAnthropic(base_url=s["anthropic_base_url"], api_key="k1", http_client=http.anthropic)
    m = await an.messages.create(model="policy", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    assert m.usage.output_tokens > 0
    bad = anthropic.AsyncAnthropic(
        base_url=s["anthropic_base_url"], api_key="k2", http_client=http.anthropic, max_retries=0
    )
    with pytest.raises(anthropic.NotFoundError):
        await bad.messages.create(model="policy", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    assert (await http.delete(f"/v1/sessions/{s['session_id']}", headers={"x-api-key": "k1"})).status_code == 200
    await open_session(http, headers={"authorization": "Bearer k1"})  # the slot is free again


async def test_episodes_batch_token_turns_and_ttl(env, model):
    app, pods, replies, http = env(session={"idle_ttl_s": 60})
    ids = []
    for i in range(3):
        s = await open_session(http, group_id="grp", sample_index=i)
        ids.append(s["session_id"])
    first = await http.post(
        f"/v1/sessions/{ids[0]}/generate",
        json={"messages": [{"role": "user", "content": "hi"}], "sampling_params": {"max_tokens": 4}},
    )
    body = first.json()
    assert len(body["token_ids"]) == 4 and body["finish_reason"] == "length" and body["num_tokens"] > 4
    nxt = (
        await http.post(f"/v1/sessions/{ids[0]}/generate", json={"append_text": "\nok", "append_token_ids": [7]})
    ).json()
    assert nxt["num_tokens"] == body["num_tokens"] + len(model.encode("\nok")) + 1 + len(nxt["token_ids"])
    await http.post(f"/v1/sessions/{ids[1]}/generate", json={"messages": [{"role": "user", "content": "yo"}]})
    res = (
        await http.post(
            "/v1/episodes",
            json={
                "episodes": [
                    {"session_id": ids[0], "reward": 1},
                    {"session_id": ids[1], "reward": 0, "score": 0.5},
                    {"session_id": "missing", "reward": 1},
                ]
            },
        )
    ).json()
    assert [r["status"] for r in res["results"]] == [200, 200, 404] and res["written"] == 2
    trajs = await written(app)
    assert sorted(t.sample_index for t in trajs) == [0, 1] and {t.group_id for t in trajs} == {"grp"}
    t0 = next(t for t in trajs if t.sample_index == 0)
    assert t0.status == "truncated" and len(t0.segments[0].action_spans) == 2
    # the third session idles past the TTL: dropped, counted, nothing written
    assert app.gateway.reap(now=10**9) == 1
    assert (await http.get(f"/v1/sessions/{ids[2]}")).status_code == 404
    metrics = (await http.get("/metrics")).text
    assert 'molt_gateway_sessions_total{outcome="expired"} 1.0' in metrics
    assert "molt_gateway_added_latency_seconds_bucket" in metrics and "molt_queue_length_entries" in metrics


async def test_token_turn_with_max_tokens_zero_only_appends(env, model):
    """Molt appends the env's feedback even after the terminal turn: masked tokens, nothing generated."""
    app, pods, replies, http = env()
    sid = (await open_session(http))["session_id"]
    first = (
        await http.post(
            f"/v1/sessions/{sid}/generate",
            json={"messages": [{"role": "user", "content": "hi"}], "sampling_params": {"max_tokens": 3}},
        )
    ).json()
    calls = len(pods.pods[app.gateway.sessions[sid].pod].calls)
    feedback = model.encode("\nCorrect!")
    last = (
        await http.post(
            f"/v1/sessions/{sid}/generate", json={"append_text": "\nCorrect!", "sampling_params": {"max_tokens": 0}}
        )
    ).json()
    assert last["token_ids"] == [] and last["num_tokens"] == first["num_tokens"] + len(feedback)
    assert len(pods.pods[app.gateway.sessions[sid].pod].calls) == calls  # the pod was not asked
    await http.post(f"/v1/sessions/{sid}/finish", json={"reward": 1})
    [traj] = await written(app)
    [seg] = traj.segments
    assert seg.token_ids.tolist()[-len(feedback) :] == feedback
    assert seg.action_spans.tolist() == [[first["num_tokens"] - 3, first["num_tokens"]]]  # feedback masked


async def test_a_first_token_turn_too_long_to_generate_keeps_its_last_tokens_with_truncate_prompt(env, model):
    """Molt's initial truncation of an Env's first observation, as the gateway's ``truncate_prompt="left"``: the
    prompt keeps its last max(1, max_length - reserve) tokens (reserve: max_tokens, else 32), the pod generates
    over them, the answer carries the kept text, and the trajectory holds exactly what the pod saw. Without the
    field such a turn stays a "length" answer with nothing generated; later turns may not ask for it."""
    app, pods, replies, http = env()
    long = " ".join(f"w{i}" for i in range(80))
    ids = model.encode(long)
    assert len(ids) > 60
    sid = (await open_session(http, max_length=40))["session_id"]
    turn = {"append_text": long, "sampling_params": {"max_tokens": 3}}
    plain = (await http.post(f"/v1/sessions/{sid}/generate", json=turn)).json()
    assert plain["token_ids"] == [] and plain["finish_reason"] == "length" and "prompt_text" not in plain
    r = (await http.post(f"/v1/sessions/{sid}/generate", json={**turn, "truncate_prompt": "left"})).json()
    assert r["prompt_tokens_dropped"] == len(ids) - 37 and r["prompt_text"] == model.decode(ids[-37:], False)
    [(prompt, _)] = pods.pods[app.gateway.sessions[sid].pod].calls
    assert prompt == ids[-37:] and len(r["token_ids"]) == 3
    again = await http.post(f"/v1/sessions/{sid}/generate", json={"append_text": "x", "truncate_prompt": "left"})
    assert again.status_code == 400 and again.json()["error"]["param"] == "truncate_prompt"
    await http.post(f"/v1/sessions/{sid}/finish", json={"reward": 1})
    [traj] = await written(app)
    assert traj.segments[0].token_ids.tolist() == ids[-37:] + r["token_ids"]

    sid = (await open_session(http, max_length=40))["session_id"]
    r = (await http.post(f"/v1/sessions/{sid}/generate", json={"append_text": long, "truncate_prompt": "left"})).json()
    assert r["prompt_text"] == model.decode(ids[-8:], False)  # no max_tokens anywhere: 32 reserved
    bad = await http.post(f"/v1/sessions/{sid}/generate", json={"append_text": long, "truncate_prompt": "right"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "truncate_prompt"
    metrics = (await http.get("/metrics")).text
    assert "molt_gateway_prompts_truncated_total 2.0" in metrics


async def test_session_values_that_would_be_ignored_are_refused_by_name(env):
    """Nothing accepted and ignored: a max_length of 0 or false is not "the default", and a session's n is 1."""
    _, _, _, http = env()
    for body, param in (
        ({"max_length": 0}, "max_length"),
        ({"max_length": False}, "max_length"),
        ({"sampling_params": {"n": 4}}, "sampling_params.n"),
    ):
        r = await http.post("/v1/sessions", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    sid = (await http.post("/v1/sessions", json={"sampling_params": {"n": 1}})).json()["session_id"]
    turn = {"append_text": "x", "sampling_params": {"n": 2}}
    r = await http.post(f"/v1/sessions/{sid}/generate", json=turn)
    assert r.status_code == 400 and r.json()["error"]["param"] == "sampling_params.n", r.text


async def test_stop_strings_cut_token_turns_as_vllm_does(env, model):
    """A Molt Env's ``SamplingParams(stop=...)`` reaches the token-level /generate on the session or per turn:
    the tokens end with the one that completes the stop string, the text before it (vLLM's output)."""
    app, pods, replies, http = env()
    for at_open, per_turn in (({"stop": ["STOP"]}, {}), ({}, {"stop": ["STOP"]})):
        sid = (await http.post("/v1/sessions", json={"sampling_params": at_open})).json()["session_id"]
        replies.queue = ["alpha STOP beta gamma<|im_end|>"]
        turn = {"messages": [{"role": "user", "content": "x"}], "sampling_params": per_turn}
        r = (await http.post(f"/v1/sessions/{sid}/generate", json=turn)).json()
        assert r["text"] == "alpha " and r["finish_reason"] == "stop", r
        assert model.decode(r["token_ids"], skip_special=True).rstrip().endswith("STOP")
        ((start, end),) = app.gateway.sessions[sid].capture.segments[0].spans
        assert list(app.gateway.sessions[sid].capture.segments[0].token_ids[start:end]) == r["token_ids"]
        assert "stop" not in pod_calls(pods)[-1][1]


async def test_stop_strings_and_session_completions(env, model):
    app, pods, replies, http = env()
    s = await open_session(http)
    oa = openai.AsyncOpenAI(base_url=s["openai_base_url"], api_key="EMPTY", http_client=http)
    replies.queue = ["Hello world. STOP more text after<|im_end|>", " then more.<|im_end|>"]
    r = await oa.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}], stop=["STOP"])
    assert r.choices[0].message.content == "Hello world. " and r.choices[0].finish_reason == "stop"
    sid = s["session_id"]
    # the recorded action is the prefix of the sampled tokens up to the one that completes "STOP"
    seg = app.gateway.sessions[sid].capture.segments[0]
    ((start, end),) = seg.spans
    assert model.decode(seg.token_ids[start:end], skip_special=True).rstrip().endswith("STOP")
    assert "more text" not in model.decode(seg.token_ids[start:end], skip_special=True)
    assert "stop" not in pod_calls(pods)[0][1]  # never sent to the pod (it takes token ids only)
    # /completions on a session: a prompt that extends the previous prompt + completion stays one segment
    s2 = await open_session(http)
    oa2 = openai.AsyncOpenAI(base_url=s2["openai_base_url"], api_key="EMPTY", http_client=http)
    replies.queue = ["Once upon", " a time"]
    c1 = await oa2.completions.create(model="policy", prompt="Story:", max_tokens=8)
    await oa2.completions.create(model="policy", prompt="Story:" + c1.choices[0].text + " and", max_tokens=8)
    seg2 = app.gateway.sessions[s2["session_id"]].capture.segments
    assert len(seg2) == 1 and len(seg2[0].spans) == 2
    assert model.decode(seg2[0].token_ids, skip_special=False) == "Story:Once upon and a time"


async def test_a_runner_that_says_truncated_marks_the_trajectory_truncated(env):
    """An env or agent that cut its episode short (Molt's Result.truncated) says so at finish, on both finish
    paths; the trainer's --reward.stop_properly_penalty_coef reads the trajectory's status."""
    app, pods, replies, http = env()
    turn = {"append_text": "hi", "sampling_params": {"max_tokens": 32}}
    sids = [(await open_session(http))["session_id"] for _ in range(4)]
    for sid in sids:
        assert (await http.post(f"/v1/sessions/{sid}/generate", json=turn)).json()["finish_reason"] == "stop"
    await http.post(f"/v1/sessions/{sids[0]}/finish", json={"reward": 1, "truncated": True})
    await http.post(f"/v1/sessions/{sids[1]}/finish", json={"reward": 1, "truncated": False})
    items = [{"session_id": sids[2], "reward": 1, "truncated": True}, {"session_id": sids[3], "reward": 1}]
    assert (await http.post("/v1/episodes", json={"episodes": items})).status_code == 200
    status = {t.trajectory_id: t.status for t in await written(app)}
    assert [status[sid] for sid in sids] == ["truncated", "completed", "truncated", "completed"]


async def test_an_abort_racing_a_finish_is_answered_in_the_order_the_stream_saw(env):
    """An abort that arrives while a finish writes waits for it and answers 409 (the trajectory stands), as does
    a second finish, with the first one's result; a finish that waited for a running turn while an abort closed
    the session is refused and writes nothing. Each answer matches what the stream holds."""
    import asyncio

    app, pods, replies, http = env()
    gw = app.gateway
    turn = {"append_text": "hi", "sampling_params": {"max_tokens": 8}}
    writing, release = asyncio.Event(), asyncio.Event()
    put_once = gw.queue.put_once

    async def held_put_once(*args, **kwargs):
        writing.set()
        await release.wait()
        return await put_once(*args, **kwargs)

    gw.queue.put_once = held_put_once
    kept, aborted = [(await open_session(http))["session_id"] for _ in range(2)]
    for sid in (kept, aborted):
        assert (await http.post(f"/v1/sessions/{sid}/generate", json=turn)).status_code == 200

    finish = asyncio.create_task(http.post(f"/v1/sessions/{kept}/finish", json={"reward": 1}))
    await writing.wait()
    again = asyncio.create_task(http.post(f"/v1/sessions/{kept}/finish", json={"reward": 1}))
    abort = asyncio.create_task(http.delete(f"/v1/sessions/{kept}"))
    await asyncio.sleep(0.1)
    assert not abort.done() and not again.done()  # both wait for the write
    release.set()
    first, second, late_abort = await asyncio.gather(finish, again, abort)
    assert first.status_code == 200 and first.json()["written"], first.text
    assert second.status_code == 200 and second.json() == first.json()
    assert late_abort.status_code == 409 and late_abort.json()["error"]["code"] == "session_closed", late_abort.text

    running = gw.sessions[aborted].lock  # held as a running turn holds it
    await running.acquire()
    blocked = asyncio.create_task(http.post(f"/v1/sessions/{aborted}/finish", json={"reward": 1}))
    await asyncio.sleep(0.1)
    r = await http.delete(f"/v1/sessions/{aborted}")
    assert r.status_code == 200 and r.json()["aborted"], r.text
    running.release()
    r = await blocked
    assert r.status_code == 409 and r.json()["error"]["code"] == "session_closed", r.text
    assert [t.trajectory_id for t in await written(app)] == [kept]
    metrics = (await http.get("/metrics")).text
    assert 'molt_gateway_sessions_total{outcome="written"} 1.0' in metrics
    assert 'molt_gateway_sessions_total{outcome="aborted"} 1.0' in metrics
