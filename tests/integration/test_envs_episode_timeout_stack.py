"""An episode's limit is set once, on the env worker: a real worker process started with a longer
--envs.episode_timeout_s than the trainer's --envs.timeout_s reports it on /readyz, and the trainer's dispatcher
(real HTTP on loopback) waits for an episode longer than its own timeout instead of cutting it and running it
again. Without the worker's report the same episode is cut at the trainer's timeout."""

from __future__ import annotations

import sys
import textwrap
import time

from molt.agents.testing import FakeGateway
from molt.serve import start_service
from services.trainer.config import EnvsConfig, RolloutConfig
from services.trainer.dispatch import EPISODE_MARGIN_S, EpisodeDispatcher
from tests.gateway_testlib import ROOT, stop
from tests.integration.envs_testlib import Served

EPISODE_S, WORKER_LIMIT_S, TRAINER_TIMEOUT_S = 2.0, 5, 1

AGENT = textwrap.dedent(f"""
    import asyncio

    from molt.agents import Env, Result, StepEnvRunner

    class Slow(Env):
        async def step(self, state):
            await asyncio.sleep({EPISODE_S})  # a long tool run
            return Result(reward=1.0)

    class AgentRunner(StepEnvRunner):
        def __init__(self):
            super().__init__(Slow)
""")


def _dispatcher(url: str) -> EpisodeDispatcher:
    cfg = EnvsConfig(urls=[url], agent="slow", timeout_s=TRAINER_TIMEOUT_S, max_retries=0)
    return EpisodeDispatcher(cfg, RolloutConfig(), 256)


def _body(i: int) -> dict:
    return {"agent": "slow", "prompt": "hi", "label": "", "group_id": f"g{i}", "sample_index": 0, "max_length": 64}


async def test_the_trainer_follows_a_workers_longer_episode_limit(tmp_path, monkeypatch):
    monkeypatch.delenv("MOLT_INTERNAL_TOKEN", raising=False)  # a loopback worker and a trainer without a token
    gateway = Served(FakeGateway(policy=lambda prompt, turn: "ok").app, "fake-gateway")
    (tmp_path / "slow.py").write_text(AGENT)
    cmd = [sys.executable, "-m", "services.envs", f"--agent=slow={tmp_path / 'slow.py'}"]
    cmd += ["--gateway.url", gateway.url, "--server.port", "0", "--server.log_level", "warning"]
    cmd += ["--envs.episode_timeout_s", str(WORKER_LIMIT_S), "--envs.finish_retry_s", "0"]
    worker, url = start_service(cmd, log_path=tmp_path / "worker.log", cwd=ROOT, timeout_s=60)
    following, unaware = _dispatcher(url), _dispatcher(url)
    try:
        await following.wait_ready(lambda: False)
        assert following.episode_timeout_s(url) == WORKER_LIMIT_S + EPISODE_MARGIN_S
        start = time.monotonic()
        result = await following.run_episode(_body(0))
        assert result["status"] == "ok" and result["written"], result
        assert time.monotonic() - start >= EPISODE_S > TRAINER_TIMEOUT_S  # it waited past its own --envs.timeout_s

        # The same episode from a dispatcher that never read /readyz: cut at the trainer's timeout, and the
        # worker's limit is learned from the probe that follows the cut.
        result = await unaware.run_episode(_body(1))
        assert result["status"] == "failed" and not result["written"]
        assert f"no answer within {TRAINER_TIMEOUT_S} s" in result["error"]
        assert unaware.episode_timeout_s(url) == WORKER_LIMIT_S + EPISODE_MARGIN_S
    finally:
        await following.close()
        await unaware.close()
        stop(worker)
        gateway.stop()
