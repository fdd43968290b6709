"""The env worker observes ``molt_envs_episode_seconds`` once per episode, labelled by agent, whatever the
episode's outcome, and serves it on /metrics (docs/envs.md, the worker's /metrics list).

The worker app runs in this process against the in-memory fake gateway, as in tests/unit/test_envs_worker.py.
"""

from __future__ import annotations

import textwrap

import httpx
import pytest

from molt.agents.testing import FakeGateway
from services.envs.app import build_app
from services.envs.config import EnvsSettings

AGENTS = textwrap.dedent("""
    import asyncio
    from molt.agents import Env, Result, StepEnvRunner

    class MyEnv(Env):
        async def step(self, state):
            if state["label"] == "raise":
                raise RuntimeError("boom")
            await asyncio.sleep(0.05)
            return Result(reward=1.0)

    class AgentRunner(StepEnvRunner):
        def __init__(self):
            super().__init__(MyEnv)
""")


@pytest.fixture
def client(tmp_path):
    path = tmp_path / "agent.py"
    path.write_text(AGENTS)
    fake = FakeGateway(policy=lambda prompt, turn: "yes")
    settings = EnvsSettings(agent=[f"echo={path}"], gateway={"url": "http://fake"}, envs={"max_concurrency": 2})
    app = build_app(settings, gateway_transport=httpx.ASGITransport(app=fake.app))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://worker")


def _req(label: str, i: int) -> dict:
    return {"agent": "echo", "prompt": "say yes", "label": label, "group_id": "g", "sample_index": i}


def _sample(metrics: str, name: str) -> float:
    [line] = [x for x in metrics.splitlines() if x.startswith(name + " ")]
    return float(line.rsplit(" ", 1)[1])


async def test_each_episode_is_observed_in_molt_envs_episode_seconds(client):
    # A failed episode's wall time counts as well as a good one's: operators read this histogram for how long
    # episodes hold a worker slot, and a crash still held one.
    assert (await client.post("/v1/episodes:run", json=_req("yes", 0))).json()["status"] == "ok"
    metrics = (await client.get("/metrics")).text
    assert _sample(metrics, 'molt_envs_episode_seconds_count{agent="echo"}') == 1.0
    assert _sample(metrics, 'molt_envs_episode_seconds_sum{agent="echo"}') >= 0.05  # the step's own sleep
    assert (await client.post("/v1/episodes:run", json=_req("raise", 1))).json()["status"] == "failed"
    metrics = (await client.get("/metrics")).text
    assert _sample(metrics, 'molt_envs_episode_seconds_count{agent="echo"}') == 2.0
    assert 'molt_envs_episode_seconds_bucket{agent="echo",le="+Inf"} 2.0' in metrics
