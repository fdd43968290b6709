"""The bounds after an episode's reward is decided, which the env worker reports and the trainer waits out
(--envs.episode_timeout_s + --envs.finish_retry_s + a margin): a finish ends with its retry budget however slow
the gateway answers, and an Env's slow close() does not hold the episode's answer. Real HTTP on loopback."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

import molt.agents.env as env_module
import molt.agents.gateway as gateway_module
from molt.agents import Env, Episode, Result, StepEnvRunner
from molt.agents.gateway import GatewayClient
from molt.agents.testing import FakeGateway
from tests.integration.envs_testlib import Served


def _slow_finish(fake: FakeGateway, delay_s: float):
    """The fake gateway, answering every finish only after ``delay_s``."""

    async def app(scope, receive, send):
        if scope["type"] == "http" and scope["path"].endswith("/finish"):
            await asyncio.sleep(delay_s)
        await fake.app(scope, receive, send)

    return app


@pytest.fixture
def slow_gateway():
    served = Served(_slow_finish(FakeGateway(policy=lambda prompt, turn: "ok"), 30.0), "slow-finish-gateway")
    yield served.url
    served.stop()


async def test_a_finish_ends_with_its_retry_budget_however_slow_the_gateway(slow_gateway, monkeypatch):
    monkeypatch.setattr(gateway_module, "FINISH_ATTEMPT_FLOOR_S", 0.5)
    client = GatewayClient(slow_gateway, finish_retry_s=0.2)  # the client's own timeout stays 300 s
    try:
        session = await client.open_session(group_id="g")
        await session.generate(append_text="hi", sampling_params={"max_tokens": 2})
        start = time.monotonic()
        with pytest.raises(httpx.ReadTimeout):
            await session.finish(1.0)
        assert time.monotonic() - start < 5
    finally:
        await client.aclose()


async def test_a_slow_close_does_not_hold_the_episodes_answer(monkeypatch):
    monkeypatch.setattr(env_module, "CLOSE_WAIT_S", 0.3)
    closed = asyncio.Event()

    class Lingering(Env):
        async def step(self, state):
            return Result(reward=1.0, terminated=True)

        async def close(self):
            await asyncio.sleep(1.0)  # a sandbox that takes long to tear down
            closed.set()

    served = Served(FakeGateway(policy=lambda prompt, turn: "ok").app, "fake-gateway")
    client = GatewayClient(served.url)
    try:
        start = time.monotonic()
        result = await StepEnvRunner(Lingering).execute(Episode(prompt="Q", group_id="g"), client)
        assert result.written and time.monotonic() - start < 0.9
        await asyncio.wait_for(closed.wait(), 5)  # the close went on and finished in the background
    finally:
        await client.aclose()
        served.stop()
