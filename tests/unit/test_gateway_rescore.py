"""--rollout.rescore_logprobs: at finish each trainable segment's action logprobs are replaced by a pod's prefill
logprobs of the segment (POST /v1/prompt_logprobs), only where they mean the same thing: plain sampling, no
images or routed experts, one policy version; anything else keeps its decode logprobs, counted by reason, and a
pod failure never fails the finish (in-process app, fake pods, the real SDK)."""

from __future__ import annotations

import json
import logging
import time
from types import SimpleNamespace

import numpy as np
import openai
import pytest

from molt.bus import QueueUnavailable
from molt.config import parse_settings
from molt.schema import Segment
from services.gateway.capture import Capture, SegmentState
from services.gateway.chat import ChatModel
from services.gateway.config import GatewaySettings, validate_settings
from services.gateway.handoff import parked_state, session_from_state
from services.gateway.rescore import action_positions, plain_sampling, replace_logprobs, rescore
from services.gateway.session import Session
from tests.gateway_testlib import fake_logprob, queued_gateway

PODS = ["http://pod-a:1", "http://pod-b:1"]
ASK = [{"role": "user", "content": "2 + 2?"}]
TEXTS = ["Four, as two plus two is four.<|im_end|>", "Six, since three and three make six.<|im_end|>"]


def prefill_logprob(token_id: int, position: int) -> float:
    """The fake pods' prefill logprob of the token at ``position``: never ``fake_logprob`` (the decode one)."""
    return -0.02 - ((token_id * 5 + position * 11) % 89) / 40.0


@pytest.fixture(scope="module")
def model(tiny_qwen3) -> ChatModel:
    return ChatModel(tiny_qwen3)


def _gateway(model: ChatModel, refuse: bool = False, fail_on: tuple[str, ...] = (), **sections):
    """A gateway with the flag on whose fake pods also answer /v1/prompt_logprobs (with ``prefill_logprob`` and
    the pod's version), a 500 from the pods in ``fail_on``, a 400 from all with ``refuse``. Each prefill call
    is recorded in ``fake.prefills`` as (pod url, token ids)."""
    rollout = {"urls": PODS, "rescore_logprobs": True, **sections.pop("rollout", {})}
    app, fake, queue, http = queued_gateway(model, PODS, rollout=rollout, **sections)
    generate = fake.post_json
    fake.prefills = []

    async def post_json(url: str, body: bytes):
        if not url.endswith("/v1/prompt_logprobs"):
            return await generate(url, body)
        base = url.removesuffix("/v1/prompt_logprobs")
        pod, _ = fake._pod(url)  # a down pod refuses the connection
        ids = json.loads(body)["token_ids"]
        fake.prefills.append((base, ids))
        if base in fail_on:
            return 500, b'{"error": {"message": "engine fell over"}}', time.perf_counter()
        if refuse:
            return 400, b'{"error": {"message": "prompt too long", "code": "invalid_value"}}', time.perf_counter()
        lps = [prefill_logprob(t, i) for i, t in enumerate(ids)][1:]
        return 200, json.dumps({"logprobs": lps, "policy_version": pod.version}).encode(), time.perf_counter()

    fake.post_json = post_json
    return app, fake, queue, http


async def _chat_twice(http, queue, sampling: dict | None = None, second: dict | None = None) -> str:
    """A two-turn chat session (one segment, two action spans, the reply and the next user message between them);
    ``second``: the second turn's own sampling params. Its id."""
    s = (await http.post("/v1/sessions", json={"sampling_params": sampling or {}})).json()
    client = openai.AsyncOpenAI(base_url=s["openai_base_url"], api_key="EMPTY", http_client=http)
    queue.extend(TEXTS)
    r = await client.chat.completions.create(model="policy", messages=ASK)
    msgs = ASK + [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "3 + 3?"}]
    await client.chat.completions.create(model="policy", messages=msgs, **(second or {}))
    return s["session_id"]


async def _finish(app, http, sid: str) -> list[Segment]:
    r = await http.post(f"/v1/sessions/{sid}/finish", json={"reward": 1.0})
    assert r.status_code == 200 and r.json()["written"], r.text
    [t] = [
        d.trajectory for d in await app.gateway.queue.read("t", 100, block_s=0) if d.trajectory.trajectory_id == sid
    ]
    return t.segments


def _decode(seg: Segment) -> np.ndarray:
    """The fake pod's decode logprobs of ``seg``'s action tokens (``fake_logprob`` counts from each turn's start)."""
    return np.array(
        [fake_logprob(int(t), i) for a, b in seg.action_spans.tolist() for i, t in enumerate(seg.token_ids[a:b])],
        np.float32,
    )


def _prefill(seg: Segment) -> np.ndarray:
    return np.array([prefill_logprob(int(seg.token_ids[p]), int(p)) for p in action_positions(seg)], np.float32)


def _count(app, name: str, *labels: str) -> float:
    return app.gateway.metrics[name].labels(*labels).sum


async def test_a_two_turn_segment_records_the_prefill_logprobs_at_its_action_tokens(model):
    app, fake, queue, http = _gateway(model)
    sid = await _chat_twice(http, queue)
    [seg] = await _finish(app, http, sid)
    assert len(seg.action_spans) == 2 and seg.action_spans[1, 0] > seg.action_spans[0, 1]  # prompt between
    [(pod, ids)] = fake.prefills
    assert ids == seg.token_ids.tolist() and pod == app.gateway.sessions[sid].pod  # the session's own pod
    np.testing.assert_array_equal(seg.logprobs, _prefill(seg))
    assert not np.array_equal(seg.logprobs, _decode(seg))
    assert _count(app, "molt_gateway_rescored_segments_total") == 1
    gap = app.gateway.metrics["molt_gateway_rescore_max_abs_diff"].labels()
    assert sum(gap.counts) == 1 and gap.sum == pytest.approx(np.abs(_prefill(seg) - _decode(seg)).max(), abs=1e-6)


def test_the_prefill_value_of_token_i_is_put_at_each_action_position():
    seg = Segment([5, 6, 7, 8, 9, 10, 11], [[1, 3], [5, 7]], [-1.0] * 4, [2] * 4)
    prefill = [-0.1, -0.2, -0.3, -0.4, -0.5, -0.6]  # log p(t_i | t_<i), i = 1..6
    assert replace_logprobs(seg, prefill, 2) == pytest.approx(0.9)
    np.testing.assert_array_equal(seg.logprobs, np.float32([-0.1, -0.2, -0.5, -0.6]))
    assert replace_logprobs(seg, prefill, 3) is None  # another version: untouched
    np.testing.assert_array_equal(seg.logprobs, np.float32([-0.1, -0.2, -0.5, -0.6]))


async def test_a_pod_on_another_version_leaves_the_decode_logprobs(model):
    app, fake, queue, http = _gateway(model)
    sid = await _chat_twice(http, queue)
    for pod in fake.pods.values():
        pod.version = 1  # a weight update landed between the last turn and the finish
    [seg] = await _finish(app, http, sid)
    assert len(fake.prefills) == 1
    np.testing.assert_array_equal(seg.logprobs, _decode(seg))
    assert _count(app, "molt_gateway_rescore_kept_segments_total", "version") == 1


async def test_a_segment_sampled_across_versions_is_not_sent(model):
    app, fake, queue, http = _gateway(model)
    s = (await http.post("/v1/sessions", json={})).json()
    client = openai.AsyncOpenAI(base_url=s["openai_base_url"], api_key="EMPTY", http_client=http)
    queue.extend(TEXTS)
    r = await client.chat.completions.create(model="policy", messages=ASK)
    for pod in fake.pods.values():
        pod.version = 1
    msgs = ASK + [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "3 + 3?"}]
    await client.chat.completions.create(model="policy", messages=msgs)
    [seg] = await _finish(app, http, s["session_id"])
    assert set(seg.versions.tolist()) == {0, 1} and fake.prefills == []
    np.testing.assert_array_equal(seg.logprobs, _decode(seg))
    assert _count(app, "molt_gateway_rescore_kept_segments_total", "version") == 1


@pytest.mark.parametrize(
    ("session", "second"),
    [
        ({"temperature": 0.7}, None),
        (None, {"temperature": 0.7}),  # one turn of the segment is enough
        (None, {"top_p": 0.9}),
        (None, {"extra_body": {"top_k": 5}}),
        (None, {"extra_body": {"min_p": 0.1}}),
        (None, {"presence_penalty": 0.5}),
        (None, {"logit_bias": {"11": 2}}),
        (None, {"extra_body": {"min_tokens": 1}}),
    ],
)
async def test_a_segment_not_sampled_from_the_models_own_distribution_keeps_its_decode_logprobs(
    model, session, second
):
    app, fake, queue, http = _gateway(model)
    sid = await _chat_twice(http, queue, session, second)
    [seg] = await _finish(app, http, sid)
    assert fake.prefills == []
    np.testing.assert_array_equal(seg.logprobs, _decode(seg))
    assert _count(app, "molt_gateway_rescore_kept_segments_total", "sampling") == 1


def test_plain_sampling_is_the_pods_defaults_only():
    assert plain_sampling({}) and plain_sampling({"temperature": 1, "top_p": 1.0, "top_k": -1, "max_tokens": 9})
    assert plain_sampling({"top_k": 0, "seed": 3, "stop_token_ids": [2], "ignore_eos": True, "logit_bias": {}})
    for bad in (
        {"temperature": 0.0},
        {"temperature": 1.2},
        {"top_k": 50},
        {"top_p": 0.95},
        {"min_p": 0.05},
        {"repetition_penalty": 1.1},
        {"frequency_penalty": 0.2},
        {"min_tokens": 4},
        {"structured_outputs": {"json_object": True}},
    ):
        assert not plain_sampling(bad), bad


async def test_a_constrained_turn_keeps_its_decode_logprobs(model):
    app, fake, queue, http = _gateway(model)
    sid = await _chat_twice(http, queue, second={"response_format": {"type": "json_object"}})
    [seg] = await _finish(app, http, sid)
    assert fake.prefills == [] and _count(app, "molt_gateway_rescore_kept_segments_total", "sampling") == 1


async def test_images_and_non_plain_sampling_keep_the_decode_logprobs():
    kinds = {
        "images": SegmentState([1, 2, 3], [(2, 3)], [-0.5], [0], images=["ab" * 32]),
        "sampling": SegmentState([1, 2, 3], [(2, 3)], [-0.5], [0], plain=False),
    }
    states = list(kinds.values())
    session = SimpleNamespace(pod=None, capture=SimpleNamespace(segments=[SegmentState([4]), *states]))
    traj = SimpleNamespace(segments=[st.to_segment() for st in states])
    pool = SimpleNamespace(pods={})  # any call to a pod would fail here
    metrics = _metrics()
    await rescore(pool, metrics, [(session, traj)])  # type: ignore[arg-type]
    assert [seg.logprobs.tolist() for seg in traj.segments] == [[-0.5]] * 2
    for reason in kinds:
        assert metrics["molt_gateway_rescore_kept_segments_total"].labels(reason).sum == 1


class _RoutingPool:
    """One healthy pod whose prefill answers -0.25 per token and, when asked, routing rows of 7 (``None``: it
    sends no routing)."""

    def __init__(self, rows: int | None) -> None:
        self.pods = {"http://p:1": SimpleNamespace(url="http://p:1", healthy=True)}
        self.rows, self.asked = rows, []

    def pick(self, exclude=frozenset()):
        return self.pods["http://p:1"]

    async def prompt_logprobs(self, pod, token_ids, routed=False):
        self.asked.append(routed)
        rows = None if self.rows is None or not routed else np.full((len(token_ids), 2, 2), self.rows, "<i2")
        return [-0.25] * (len(token_ids) - 1), 0, rows


@pytest.mark.parametrize("sends_routing", [True, False])
async def test_a_segment_with_routing_takes_the_routing_of_the_same_pass(sends_routing):
    """The trainer replays a segment's routing in the forward that its logprobs are compared with: a rescored
    segment takes the prefill pass's routing with its logprobs, or keeps both of its own when the pod sends none."""
    state = SegmentState([1, 2, 3], [(1, 3)], [-0.5, -0.5], [0, 0], routed_experts=np.zeros((3, 2, 2), "<i2"))
    session = SimpleNamespace(pod=None, capture=SimpleNamespace(segments=[state]))
    traj = SimpleNamespace(segments=[state.to_segment()])
    pool, metrics = _RoutingPool(7 if sends_routing else None), _metrics()
    await rescore(pool, metrics, [(session, traj)])  # type: ignore[arg-type]
    [seg] = traj.segments
    assert pool.asked == [True]
    if sends_routing:
        assert seg.logprobs.tolist() == [-0.25, -0.25] and (seg.routed_experts == 7).all()
        assert metrics["molt_gateway_rescored_segments_total"].labels().sum == 1
    else:
        assert seg.logprobs.tolist() == [-0.5, -0.5] and (seg.routed_experts == 0).all()
        assert metrics["molt_gateway_rescore_kept_segments_total"].labels("routed_experts").sum == 1


def _metrics():
    from services.gateway.metrics import gateway_metrics

    return gateway_metrics()


async def test_the_other_pod_answers_when_the_sessions_pod_fails(model):
    app, fake, queue, http = _gateway(model)
    sid = await _chat_twice(http, queue)
    own = app.gateway.sessions[sid].pod
    other = next(u for u in PODS if u != own)
    fake.pods[own].down = True
    [seg] = await _finish(app, http, sid)
    assert [p for p, _ in fake.prefills] == [other]
    np.testing.assert_array_equal(seg.logprobs, _prefill(seg))
    assert not app.gateway.pool.pods[own].healthy


async def test_a_pod_error_on_every_pod_keeps_the_decode_logprobs_and_writes_the_trajectory(model, caplog):
    app, fake, queue, http = _gateway(model, fail_on=tuple(PODS))
    sids = [await _chat_twice(http, queue) for _ in range(2)]
    with caplog.at_level(logging.WARNING, "molt.gateway"):
        r = await http.post("/v1/episodes", json={"episodes": [{"session_id": s, "reward": 1.0} for s in sids]})
    assert r.status_code == 200 and all(x["written"] for x in r.json()["results"]), r.text
    trajs = [d.trajectory for d in await app.gateway.queue.read("t", 100, block_s=0)]
    assert sorted(t.trajectory_id for t in trajs) == sorted(sids)
    for t in trajs:
        [seg] = t.segments
        np.testing.assert_array_equal(seg.logprobs, _decode(seg))
    # Both pods were tried; each failure marks its pod unhealthy, so it is not asked again until its next probe.
    assert sorted({p for p, _ in fake.prefills}) == PODS and len(fake.prefills) <= 4
    assert _count(app, "molt_gateway_rescore_kept_segments_total", "pod_error") == 2
    assert len([r for r in caplog.records if "could not rescore" in r.getMessage()]) == 1  # once per finish call


async def test_a_refused_segment_keeps_its_decode_logprobs(model):
    app, fake, queue, http = _gateway(model, refuse=True)
    sid = await _chat_twice(http, queue)
    [seg] = await _finish(app, http, sid)
    assert len(fake.prefills) == 1 and all(p.healthy for p in app.gateway.pool.pods.values())
    np.testing.assert_array_equal(seg.logprobs, _decode(seg))
    assert _count(app, "molt_gateway_rescore_kept_segments_total", "refused") == 1


async def test_a_finish_retried_after_a_503_rescores_again(model):
    app, fake, queue, http = _gateway(model, session={"finish_wait_s": 0})
    sid = await _chat_twice(http, queue)
    put_once = app.gateway.queue.put_once
    fails = [True]

    async def unavailable_once(*args, **kwargs):
        if fails.pop() if fails else False:
            raise QueueUnavailable("redis is restarting")
        return await put_once(*args, **kwargs)

    app.gateway.queue.put_once = unavailable_once
    r = await http.post(f"/v1/sessions/{sid}/finish", json={"reward": 1.0})
    assert r.status_code == 503
    [seg] = await _finish(app, http, sid)
    assert len(fake.prefills) == 2 and fake.prefills[0] == fake.prefills[1]
    np.testing.assert_array_equal(seg.logprobs, _prefill(seg))
    assert app.gateway.sessions[sid].capture.segments == []  # freed once written, as without the flag


async def test_off_by_default_asks_nothing(model):
    app, fake, queue, http = _gateway(model, rollout={"rescore_logprobs": False})
    sid = await _chat_twice(http, queue)
    [seg] = await _finish(app, http, sid)
    assert fake.prefills == []
    np.testing.assert_array_equal(seg.logprobs, _decode(seg))


def test_the_flag_parses_and_refuses_top_logprobs():
    base = ["--model", "m"]
    assert parse_settings(GatewaySettings, [*base, "--rollout.rescore_logprobs"], environ={}).rollout.rescore_logprobs
    off = parse_settings(GatewaySettings, [*base, "--no-rollout.rescore_logprobs"], environ={})
    assert off.rollout.rescore_logprobs is False
    both = parse_settings(
        GatewaySettings, [*base, "--rollout.rescore_logprobs", "--rollout.top_logprobs", "4"], environ={}
    )
    with pytest.raises(ValueError, match=r"--rollout\.rescore_logprobs.*--rollout\.top_logprobs") as exc:
        validate_settings(both)
    assert "\n" not in str(exc.value)
    validate_settings(parse_settings(GatewaySettings, [*base, "--rollout.top_logprobs", "4"], environ={}))


def test_whether_a_segment_was_plain_survives_parking():
    plain, not_plain = SegmentState([1, 2], [(1, 2)], [-0.5], [0]), SegmentState([3, 4], [(1, 2)], [-1.0], [0])
    not_plain.plain = False
    s = Session("s1", None, "g", 0, None, "", "", {}, {}, Capture(64, [plain, not_plain]))
    parked = parked_state(s)
    back = session_from_state(parked["state"], parked["segments"], None).capture.segments
    assert [seg.plain for seg in back] == [True, False]
    older = json.loads(parked["segments"])  # parked by a replica that predates the field: unknown, not plain
    for fields in older:
        del fields["plain"]
    back = session_from_state(parked["state"], json.dumps(older).encode(), None).capture.segments
    assert [seg.plain for seg in back] == [False, False]
