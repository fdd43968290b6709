"""--rollout.top_logprobs K: every captured turn asks the pod for its K most likely tokens per generated token, and
the trajectory holds them (``Segment.top_ids`` / ``top_logprobs``, one row per action token, in ``logprobs``'
order), on every path a segment is built by; a client gets only the alternatives it asked for (in-process app,
fake pods answering ``fake_top_logprobs``, the real SDKs)."""

from __future__ import annotations

import json
import math

import anthropic
import numpy as np
import openai
import pytest

from molt.config import parse_settings
from services.gateway.capture import Capture, SegmentState
from services.gateway.chat import ChatModel
from services.gateway.config import GatewaySettings
from services.gateway.handoff import parked_state, session_from_state
from services.gateway.session import Session
from tests.gateway_testlib import fake_top_logprobs, queued_gateway, stream_steps

PODS = ["http://pod-a:1", "http://pod-b:1"]
ASK = [{"role": "user", "content": "2 + 2?"}]
TEXTS = ["Four, as two plus two is four.<|im_end|>", "Six, since three and three make six.<|im_end|>"]


@pytest.fixture(scope="module")
def model(tiny_qwen3) -> ChatModel:
    return ChatModel(tiny_qwen3)


def _gateway(model: ChatModel, k: int, answer: bool = True, **sections):
    app, fake, queue, http = queued_gateway(model, PODS, rollout={"urls": PODS, "top_logprobs": k}, **sections)
    fake.top_logprobs = answer
    return app, fake, queue, http


async def _open(http, **body) -> dict:
    return (await http.post("/v1/sessions", json=body)).json()


async def _segments(app, http, sid: str) -> list:
    assert (await http.post(f"/v1/sessions/{sid}/finish", json={"reward": 1.0})).json()["written"]
    [t] = [
        d.trajectory for d in await app.gateway.queue.read("t", 100, block_s=0) if d.trajectory.trajectory_id == sid
    ]
    return t.segments


def _expected(ids: list[int], asked: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """What the fake pod's rows for one turn's tokens ``ids`` (asked for ``asked``) record at K = ``k``."""
    rows = [fake_top_logprobs(t, i, asked)[:k] for i, t in enumerate(ids)]
    rows = [r + [[0, -math.inf]] * (k - len(r)) for r in rows]
    return np.array([[a for a, _ in r] for r in rows], np.int32), np.array(
        [[b for _, b in r] for r in rows], np.float32
    )


def _check(seg, k: int, asked: int | None = None) -> None:
    """Each span is one turn's tokens: its rows are the fake pod's for them, the sampled token's first (the fake
    ranks it best), so the first column is ``logprobs`` itself."""
    assert seg.top_ids.shape == seg.top_logprobs.shape == (seg.num_action_tokens, k)
    at = 0
    for start, end in seg.action_spans.tolist():
        ids, lps = _expected(seg.token_ids[start:end].tolist(), asked or k, k)
        np.testing.assert_array_equal(seg.top_ids[at : at + end - start], ids)
        np.testing.assert_array_equal(seg.top_logprobs[at : at + end - start], lps)
        at += end - start
    np.testing.assert_array_equal(seg.top_logprobs[:, 0], seg.logprobs)
    seg.validate()


async def test_a_two_turn_session_records_rows_aligned_with_its_action_tokens(model):
    app, fake, queue, http = _gateway(model, 3)
    s = await _open(http)
    client = openai.AsyncOpenAI(base_url=s["openai_base_url"], api_key="EMPTY", http_client=http)
    queue.extend(TEXTS)
    r = await client.chat.completions.create(model="policy", messages=ASK)
    assert r.choices[0].logprobs is None  # the client did not ask
    msgs = ASK + [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "3 + 3?"}]
    await client.chat.completions.create(model="policy", messages=msgs)
    [seg] = await _segments(app, http, s["session_id"])
    assert len(seg.action_spans) == 2 and seg.num_action_tokens > 8  # a short row (every fourth) included
    _check(seg, 3)
    assert np.isneginf(seg.top_logprobs[3, 2]) and seg.top_ids[3, 2] == 0
    assert [sp["top_logprobs"] for p in fake.pods.values() for _, sp in p.calls] == [3, 3]


@pytest.mark.parametrize("n", [1, 5])
async def test_a_client_gets_its_own_top_logprobs_and_the_trajectory_k(model, n):
    app, fake, queue, http = _gateway(model, 3)
    s = await _open(http)
    client = openai.AsyncOpenAI(base_url=s["openai_base_url"], api_key="EMPTY", http_client=http)
    queue.append(TEXTS[0])
    r = await client.chat.completions.create(model="policy", messages=ASK, logprobs=True, top_logprobs=n)
    got = r.choices[0].logprobs.content
    assert [len(t.top_logprobs) for t in got] == [
        min(n, len(fake_top_logprobs(0, i, max(n, 3)))) for i in range(len(got))
    ]
    [seg] = await _segments(app, http, s["session_id"])
    _check(seg, 3, asked=max(n, 3))
    assert [sp["top_logprobs"] for p in fake.pods.values() for _, sp in p.calls] == [max(n, 3)]


async def test_k_zero_asks_for_nothing_and_writes_no_top_fields(model):
    app, fake, queue, http = _gateway(model, 0)
    s = await _open(http)
    client = openai.AsyncOpenAI(base_url=s["openai_base_url"], api_key="EMPTY", http_client=http)
    queue.extend(TEXTS)
    await client.chat.completions.create(model="policy", messages=ASK)
    r = await client.chat.completions.create(model="policy", messages=ASK, logprobs=True, top_logprobs=2, seed=1)
    got = r.choices[0].logprobs.content
    assert [len(t.top_logprobs) for t in got] == [len(fake_top_logprobs(0, i, 2)) for i in range(len(got))]
    segs = await _segments(app, http, s["session_id"])
    assert segs and all(seg.top_ids is None and seg.top_logprobs is None for seg in segs)
    assert [sp.get("top_logprobs") for p in fake.pods.values() for _, sp in p.calls] == [None, 2]


async def _chat(client, stream: bool) -> None:
    msgs = list(ASK)
    for _ in range(2):
        if stream:
            text = "".join(
                [
                    c.choices[0].delta.content or ""
                    async for c in await client.chat.completions.create(model="policy", messages=msgs, stream=True)
                    if c.choices
                ]
            )
        else:
            text = (await client.chat.completions.create(model="policy", messages=msgs)).choices[0].message.content
        msgs += [{"role": "assistant", "content": text}, {"role": "user", "content": "3 + 3?"}]


async def _anthropic(client, stream: bool) -> None:
    if stream:
        async with client.messages.stream(model="policy", max_tokens=64, messages=ASK) as st:
            await st.get_final_message()
    else:
        await client.messages.create(model="policy", max_tokens=64, messages=ASK)


async def _responses(client, stream: bool) -> None:
    if stream:
        [e async for e in await client.responses.create(model="policy", input="2 + 2?", stream=True)]
    else:
        await client.responses.create(model="policy", input="2 + 2?")


@pytest.mark.parametrize("wire", [_chat, _anthropic, _responses], ids=["chat", "anthropic", "responses"])
async def test_a_streamed_turn_records_what_an_unstreamed_one_does(model, wire):
    app, _fake, queue, http = _gateway(model, 4)
    stream_steps(app, _fake)
    recorded = []
    for stream in (False, True):
        s = await _open(http)
        if wire is _anthropic:
            client = anthropic.AsyncAnthropic(
                base_url=s["anthropic_base_url"], api_key="E", http_client=http.anthropic
            )
        else:
            client = openai.AsyncOpenAI(base_url=s["openai_base_url"], api_key="EMPTY", http_client=http)
        queue.extend(TEXTS)
        await wire(client, stream)
        queue.clear()
        [seg] = await _segments(app, http, s["session_id"])
        _check(seg, 4)
        recorded.append(seg)
    plain, streamed = recorded
    for name in ("token_ids", "action_spans", "logprobs", "top_ids", "top_logprobs"):
        np.testing.assert_array_equal(getattr(plain, name), getattr(streamed, name), err_msg=name)


async def test_rewrites_stops_prefills_and_failover_keep_rows_aligned(model):
    """A history rewrite seals the segment and starts another; a stop string cuts the rows with the tokens; a
    prefill's continuation and a turn replayed on another pod record theirs."""
    app, fake, queue, http = _gateway(model, 2)
    s = await _open(http)
    client = openai.AsyncOpenAI(base_url=s["openai_base_url"], api_key="EMPTY", http_client=http)
    queue.extend([TEXTS[0], TEXTS[1], "Eight, no doubt.<|im_end|>", " that is all.<|im_end|>"])
    await client.chat.completions.create(model="policy", messages=ASK)
    edited = ASK + [{"role": "assistant", "content": "Five."}, {"role": "user", "content": "3 + 3?"}]
    r = await client.chat.completions.create(model="policy", messages=edited, stop=["three"])
    assert r.choices[0].message.content == "Six, since "
    fake.pods[app.gateway.sessions[s["session_id"]].pod].down = True  # the next turn fails over
    await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "4 + 4?"}])
    prefill = [{"role": "user", "content": "Go on."}, {"role": "assistant", "content": "Well,"}]
    await client.chat.completions.create(
        model="policy", messages=prefill, extra_body={"continue_final_message": True, "add_generation_prompt": False}
    )
    events = (await http.get(f"/v1/sessions/{s['session_id']}")).json()["events"]
    assert [e["turn"] for e in events if e["kind"] == "pod_switch"] == [2]
    segs = await _segments(app, http, s["session_id"])
    assert len(segs) == 4 and segs[1].num_action_tokens == len(model.encode("Six, since three"))
    for seg in segs:
        _check(seg, 2)


async def test_token_level_and_completion_turns_record_rows(model):
    app, _fake, queue, http = _gateway(model, 3)
    s = await _open(http)
    sid = s["session_id"]
    queue.extend(TEXTS)
    await http.post(f"/v1/sessions/{sid}/generate", json={"messages": ASK})
    await http.post(f"/v1/sessions/{sid}/generate", json={"append_text": "\nok", "sampling_params": {"max_tokens": 0}})
    r = await http.post(
        f"/v1/sessions/{sid}/generate", json={"append_text": "\nmore", "sampling_params": {"max_tokens": 5}}
    )
    assert r.json()["finish_reason"] == "length"  # cut at max_tokens: its rows too
    [seg] = await _segments(app, http, sid)
    assert len(seg.action_spans) == 2
    _check(seg, 3)

    c = await _open(http)
    client = openai.AsyncOpenAI(base_url=c["openai_base_url"], api_key="EMPTY", http_client=http)
    queue.extend(TEXTS)
    first = await client.completions.create(model="policy", prompt="2 + 2 =")
    await client.completions.create(model="policy", prompt="2 + 2 =" + first.choices[0].text + " and 3 + 3 =")
    [seg] = await _segments(app, http, c["session_id"])
    assert len(seg.action_spans) == 2
    _check(seg, 3)


async def test_a_pod_that_sends_no_rows_is_not_recorded(model):
    app, _fake, queue, http = _gateway(model, 2, answer=False)
    s = await _open(http)
    queue.append(TEXTS[0])
    body = {"model": "policy", "messages": ASK}
    r = await http.post(f"/s/{s['session_id']}/v1/chat/completions", json=body)
    assert r.status_code == 502 and r.json()["error"]["code"] == "pod_error"
    assert (await http.post(f"/v1/sessions/{s['session_id']}/finish", json={"reward": 1.0})).json()["written"] is False


def test_the_flag_is_bounded(capsys):
    for bad in ("257", "-1"):
        with pytest.raises(SystemExit) as exc:
            parse_settings(GatewaySettings, ["--model", "m", "--rollout.top_logprobs", bad], environ={})
        assert exc.value.code == 2
        assert f"--rollout.top_logprobs {bad}: must be in [0, 256]" in capsys.readouterr().err
    assert parse_settings(GatewaySettings, ["--rollout.top_logprobs", "64"], environ={}).rollout.top_logprobs == 64
    assert GatewaySettings().rollout.top_logprobs == 0


async def test_a_pod_whose_bound_is_below_k_is_not_routed_to(model, caplog):
    """A head wider than OpenAI's 20 needs pods started with --vllm.max_logprobs K; one that reports less on
    /readyz would refuse every captured turn, so the probe marks it unhealthy with the fix."""
    app, fake, queue, http = _gateway(model, 24)
    fake.pods[PODS[0]].max_logprobs, fake.pods[PODS[1]].max_logprobs = 20, 24
    pool = app.gateway.pool
    for pod in pool.pods.values():
        await pool.probe(pod)
    assert [p.url for p in pool.pods.values() if p.healthy] == [PODS[1]]
    assert "start the pod with --vllm.max_logprobs 24" in pool.pods[PODS[0]].last_error
    s = await _open(http)
    queue.append(TEXTS[0])
    r = await http.post(f"/s/{s['session_id']}/v1/chat/completions", json={"model": "policy", "messages": ASK})
    assert r.status_code == 200 and fake.pods[PODS[0]].calls == []
    assert fake.pods[PODS[1]].calls[0][1]["top_logprobs"] == 24


def _rows(n: int, k: int, at: int = 0) -> tuple[np.ndarray, np.ndarray]:
    ids = np.arange(at * k, (at + n) * k, dtype=np.int32).reshape(n, k)
    return ids, -np.ones((n, k), np.float32)


def test_a_segment_holds_rows_for_every_action_token_or_none():
    seg = SegmentState([1, 2, 3])
    seg.extend_top(0, _rows(2, 3))
    seg.extend_top(2, _rows(1, 2, at=5))  # another K (an adopted session): the narrower kept
    assert seg.top_ids is not None and seg.top_ids.shape == (3, 2) and seg.top_ids[2].tolist() == [10, 11]
    seg.extend_top(3, None)  # a turn without rows: none for the segment
    assert seg.top_ids is None and seg.top_logprobs is None
    seg.extend_top(4, _rows(1, 2))  # earlier tokens have none: still none
    assert seg.top_ids is None


def test_rows_survive_parking_with_their_inf():
    seg = SegmentState([1, 2, 3, 4], [(2, 4)], [-0.5, -0.25], [3, 3])
    seg.top_ids = np.array([[7, 0], [9, 8]], np.int32)
    seg.top_logprobs = np.array([[-0.5, -np.inf], [-0.25, -1.5]], np.float32)
    plain = SegmentState([5, 6], [(1, 2)], [-1.0], [3])
    s = Session("s1", None, "g", 0, None, "", "", {}, {}, Capture(64, [seg, plain]))
    parked = parked_state(s)
    back, none = session_from_state(parked["state"], parked["segments"], None).capture.segments
    assert back.top_ids.dtype == np.int32 and back.top_logprobs.dtype == np.float32
    np.testing.assert_array_equal(back.top_ids, seg.top_ids)
    np.testing.assert_array_equal(back.top_logprobs, seg.top_logprobs)
    assert none.top_ids is None and none.top_logprobs is None


async def test_a_pod_whose_rows_do_not_match_its_tokens_fails_over(model):
    app, fake, queue, http = _gateway(model, 2)
    answer = fake.post_json

    async def short_rows_on_a(url: str, body: bytes):
        status, raw, at = await answer(url, body)
        if url.startswith(PODS[0]):
            data = json.loads(raw)
            data["outputs"][0]["top_logprobs"].pop()
            raw = json.dumps(data).encode()
        return status, raw, at

    fake.post_json = short_rows_on_a  # type: ignore[method-assign]
    app.gateway.pool.pods[PODS[1]].sessions = 1  # pod-a is the less loaded: tried first
    s = await _open(http)
    queue.extend([TEXTS[0], TEXTS[0]])
    r = await http.post(f"/s/{s['session_id']}/v1/chat/completions", json={"model": "policy", "messages": ASK})
    assert r.status_code == 200 and not app.gateway.pool.pods[PODS[0]].healthy
    [seg] = await _segments(app, http, s["session_id"])
    _check(seg, 2)
