"""Two real rollout pods behind one gateway with API keys: a pod is killed mid-episode (and mid-request).

The session must finish on the surviving pod from its exact token prefix, the switch must be recorded
in the trajectory, and the stream must hold exactly one complete trajectory (nothing half-written).
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid

import httpx
import openai
import pytest
import redis

from molt.bus.redis_stream import RedisTrajectoryQueue
from tests.gateway_testlib import start_gateway, start_rollout_pods, stop

pytestmark = [pytest.mark.vllm, pytest.mark.redis]
KEY = "key-one"


@pytest.fixture(scope="module")
def fleet(tiny_qwen3, redis_url, tmp_path_factory):
    logs = tmp_path_factory.mktemp("gwf")
    stream = f"molt:test:gateway-failover:{uuid.uuid4().hex[:8]}"
    pods = []
    gw = None
    try:
        pods = start_rollout_pods(tiny_qwen3, [logs / "pod0.log", logs / "pod1.log"])
        gw, url = start_gateway(
            [
                "--model",
                str(tiny_qwen3),
                "--rollout.urls",
                ",".join(u for _, u in pods),
                "--redis.url",
                redis_url,
                "--redis.stream",
                stream,
                "--session.max_length",
                "1024",
                "--auth.api_keys",
                KEY,
                "other-key",
                "--auth.max_open_sessions_per_key",
                "2",
                "--rollout.health_interval_s",
                "0.5",
            ],
            logs / "gateway.log",
        )
        yield {"url": url, "pods": dict((u, p) for p, u in pods), "redis": redis_url, "stream": stream}
    finally:
        if gw is not None:
            stop(gw)
        for p, _ in pods:
            stop(p)
        r = redis.Redis.from_url(redis_url)
        r.delete(stream, f"{stream}:dead", *r.scan_iter(match=f"{stream}:consumed:check:*"))
        r.close()


def _headers(key: str = KEY) -> dict:
    return {"authorization": f"Bearer {key}"}


def _entries(fleet) -> list:
    async def go():
        q = RedisTrajectoryQueue(fleet["redis"], fleet["stream"], group="check")
        try:
            return [d.trajectory for d in await q.read("c", 100, block_s=0.2)]
        finally:
            await q.close()

    return asyncio.run(go())


def test_bad_keys_and_session_limits(fleet):
    url = fleet["url"]
    assert httpx.post(url + "/v1/sessions", json={}).status_code == 401
    no_key = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        no_key.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}])
    a = httpx.post(url + "/v1/sessions", json={}, headers=_headers()).json()
    b = httpx.post(url + "/v1/sessions", json={}, headers=_headers()).json()
    r = httpx.post(url + "/v1/sessions", json={}, headers=_headers())
    assert r.status_code == 429 and int(r.headers["retry-after"]) > 0
    other = openai.OpenAI(base_url=a["openai_base_url"], api_key="other-key", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        other.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}])
    for s in (a, b):
        assert httpx.delete(f"{url}/v1/sessions/{s['session_id']}", headers=_headers()).status_code == 200


def test_pod_killed_mid_episode_session_finishes_on_the_other(fleet):
    url = fleet["url"]
    s = httpx.post(
        url + "/v1/sessions",
        headers=_headers(),
        json={"sampling_params": {"ignore_eos": True}, "group_id": "failover"},
    ).json()
    sid = s["session_id"]
    client = openai.OpenAI(base_url=s["openai_base_url"], api_key=KEY, max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "Count slowly."}]
    r1 = client.chat.completions.create(model="policy", messages=messages, max_tokens=8)
    first = httpx.get(f"{url}/v1/sessions/{sid}", headers=_headers()).json()["pod"]
    messages += [r1.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Keep going."}]
    # A long generation on the sticky pod; kill that pod while the request is in flight.
    result: dict = {}
    worker = threading.Thread(
        target=lambda: result.setdefault(
            "r", client.chat.completions.create(model="policy", messages=messages, max_tokens=700)
        )
    )
    worker.start()
    time.sleep(0.6)
    assert worker.is_alive(), "the generation finished before the pod could be killed; raise max_tokens"
    fleet["pods"][first].kill()
    fleet["pods"][first].wait()
    worker.join(120)
    r2 = result["r"]
    assert r2.usage.completion_tokens == 700
    summary = httpx.get(f"{url}/v1/sessions/{sid}", headers=_headers()).json()
    assert summary["pod"] != first and summary["segments"] == 1 and summary["turns"] == 2
    assert _entries(fleet) == []  # nothing reaches the stream before finish
    messages += [r2.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Done?"}]
    client.chat.completions.create(model="policy", messages=messages, max_tokens=8)
    res = httpx.post(f"{url}/v1/episodes", headers=_headers(), json={"episodes": [{"session_id": sid, "reward": 1}]})
    assert res.json()["results"][0]["written"] is True
    [traj] = _entries(fleet)
    [seg] = traj.segments
    spans = seg.action_spans.tolist()
    assert [e - b for b, e in spans] == [8, 700, 8]
    start, event = traj.events
    assert (start["kind"], start["pod"]) == ("pod", first)
    assert event["kind"] == "pod_switch" and event["from"] == first and event["to"] == summary["pod"]
    assert event["at_token"] == spans[1][0]  # resent from the exact prefix before the second action
    # the surviving pod reproduces nothing it did not generate: each span's logprobs are finite, <= 0
    assert seg.logprobs.shape[0] == 716 and (seg.logprobs <= 0).all()
    metrics = httpx.get(url + "/metrics").text
    assert f'molt_gateway_pod_failovers_total{{rollout_url="{first}"}} 1.0' in metrics
    assert f'molt_gateway_pod_healthy{{rollout_url="{first}"}} 0.0' in metrics
