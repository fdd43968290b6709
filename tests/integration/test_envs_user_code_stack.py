"""User code that stretches the episode on the real stack: rollout pod (real vLLM, tiny Qwen3) + gateway + Redis + an
env worker over HTTP. The worker's answer must agree with the stream, and an episode that would fail the same way
every time must fail, not be reported as an outage that the trainer's dispatcher waits out by rerunning it."""

from __future__ import annotations

import contextlib
import textwrap
import threading
import time
import uuid

import httpx
import pytest
from envs_testlib import Served

pytestmark = [pytest.mark.redis, pytest.mark.vllm, pytest.mark.timeout(300)]

AGENT = textwrap.dedent("""
    import asyncio

    from molt.agents import Env, Result, StepEnvRunner

    class UserEnv(Env):
        async def step(self, state):
            if state["label"] == "slow":
                await asyncio.sleep(1.0)
            if state["label"] == "huge_feedback" and len(state["observation_text"]) < 1000:
                return Result(reward=0.0, observation="x" * (16 << 20), terminated=False)  # 16 MB of feedback
            return Result(reward=1.0)

    class AgentRunner(StepEnvRunner):
        def __init__(self):
            super().__init__(UserEnv)
""")


@pytest.fixture(scope="module")
def pod(tiny_qwen3):
    from rollout_testlib import tiny_settings

    from services.rollout.app import build_app as build_rollout

    served = Served(build_rollout(tiny_settings(tiny_qwen3)), "rollout-pod")
    # A cold engine's first generation takes seconds: warmed here so that the episodes' deadlines below do not.
    body = {"prompt_token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 4}}
    httpx.post(served.url + "/v1/generate", json=body, timeout=120).raise_for_status()
    yield served.url
    served.stop()


@contextlib.contextmanager
def _stack(pod: str, model, redis_url: str, tmp_path, redis: dict, session: dict, envs: dict):
    """A gateway on its own stream and a worker serving AGENT as "user"; yields (worker url, gateway url, stream)."""
    import redis as redis_lib

    from services.envs.app import build_app as build_worker
    from services.envs.config import EnvsSettings
    from services.gateway.app import build_app as build_gateway
    from services.gateway.config import GatewaySettings

    stream = f"molt:test:user-code:{uuid.uuid4().hex[:8]}"
    agent = tmp_path / "user.py"
    agent.write_text(AGENT)
    served: list[Served] = []
    try:
        gw_settings = {
            "model": {"path": str(model)},
            "rollout": {"urls": [pod]},
            "redis": {"url": redis_url, "stream": stream, **redis},
            "session": {"max_length": 128, "max_tokens": 4, **session},
        }
        gateway = Served(build_gateway(GatewaySettings.model_validate(gw_settings)), "gateway")
        served.append(gateway)
        settings = EnvsSettings(agent=[f"user={agent}"], gateway={"url": gateway.url}, envs=envs)
        served.append(Served(build_worker(settings), "env-worker"))
        yield served[1].url, gateway.url, stream
    finally:
        for s in reversed(served):
            s.stop()
        r = redis_lib.Redis.from_url(redis_url)
        keys = list(r.scan_iter(match=f"{stream}*"))
        if keys:
            r.delete(*keys)
        r.close()


async def _run(client: httpx.AsyncClient, label: str, group: str) -> httpx.Response:
    body = {"agent": "user", "prompt": "hi", "label": label, "group_id": group}
    body["sampling_params"] = {"max_tokens": 4, "temperature": 1.0}
    return await client.post("/v1/episodes:run", json=body)


async def test_a_finish_waiting_on_a_full_stream_outlives_the_episode_deadline(pod, tiny_qwen3, redis_url, tmp_path):
    import redis

    from molt.schema import decode

    r = redis.Redis.from_url(redis_url)
    # One entry fills the stream: the next finish waits for the trainer to drain it, past the episode's deadline.
    full = {"max_len": 1}
    with _stack(pod, tiny_qwen3, redis_url, tmp_path, full, {"finish_wait_s": 60}, {"episode_timeout_s": 5}) as (
        worker,
        gateway,
        stream,
    ):
        async with httpx.AsyncClient(base_url=worker, timeout=120) as client:
            first = (await _run(client, "fast", "g-first")).json()
            assert first["status"] == "ok" and first["written"] and r.xlen(stream) == 1

            def drain():  # the trainer catches up well after the episode's deadline
                time.sleep(8)
                r.xdel(stream, *[entry_id for entry_id, _ in r.xrange(stream)])

            drainer = threading.Thread(target=drain, daemon=True)
            drainer.start()
            second = (await _run(client, "slow", "g-second")).json()
            drainer.join()

        until = time.monotonic() + 5  # the gateway's write may land after an answer that gave up on it
        while not r.xlen(stream) and time.monotonic() < until:
            time.sleep(0.1)
        written = [decode(fields[b"d"]).trajectory_id for _, fields in r.xrange(stream)]
        assert written == [second["trajectory_id"]]  # the gateway wrote it once the stream had room
        # ...and the worker says so: "timeout" would have the dispatcher run a second rollout of the sample
        assert second["status"] == "ok" and second["written"], second
        metrics = httpx.get(gateway + "/metrics").text
        assert 'molt_gateway_sessions_total{outcome="aborted"}' not in metrics
    r.close()


async def test_feedback_over_the_gateways_body_limit_fails_the_episode_not_an_outage(
    pod, tiny_qwen3, redis_url, tmp_path
):
    small = {"max_body_bytes": 1 << 20}  # the gateway answers a bigger body 413 and drops the upload
    with _stack(pod, tiny_qwen3, redis_url, tmp_path, {}, small, {"episode_timeout_s": 60}) as (worker, _, stream):
        async with httpx.AsyncClient(base_url=worker, timeout=120) as client:
            resp = await _run(client, "huge_feedback", "g-huge")
            assert resp.status_code == 200, resp.text  # a 503 would have the dispatcher rerun it forever
            body = resp.json()
            assert body["status"] == "failed" and not body["written"]
            assert "--session.max_body_bytes" in body["error"] or "413" in body["error"], body
            ok = await _run(client, "fast", "g-after")  # the worker and the gateway carry on
            assert ok.status_code == 200 and ok.json()["written"]
