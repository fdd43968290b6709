"""The env worker's loop watchdog (services/envs/watchdog.py) on a real event loop: an agent's step that blocks in
a real ``time.sleep`` is named in the log (its file, line and code, its episode and agent, the fix), reminded of
while it stays stuck, counted once, and its end logged; an agent that awaits instead trips nothing."""

from __future__ import annotations

import asyncio
import logging
import textwrap

import httpx
import pytest

from molt.agents.gateway import GatewayClient
from molt.agents.testing import FakeGateway
from services.envs import watchdog
from services.envs.metrics import envs_metrics, stall_counter
from services.envs.watchdog import LoopWatchdog
from services.envs.worker import EpisodeRequest, EpisodeWorker

AGENT = textwrap.dedent("""
    import asyncio
    import time

    from molt.agents import Env, Result, StepEnvRunner

    def crunch(seconds):
        time.sleep(seconds)  # the blocking call

    class Blocker(Env):
        async def step(self, state):
            if state["label"] == "warm-up":
                return Result(reward=1.0)
            if state["label"] == "await":
                await asyncio.sleep(STALL)
            else:
                crunch(STALL)
            return Result(reward=1.0)

    class AgentRunner(StepEnvRunner):
        def __init__(self):
            super().__init__(Blocker)
""")
STALL_S = 0.3  # the watchdog's threshold here: its reminder comes every REPEAT x this
BLOCK_S = 3.0  # past the first warning and one reminder (at about 2.1 s), short of a second
CALL_LINE = AGENT.splitlines().index("            crunch(STALL)") + 1
SLEEP_LINE = AGENT.splitlines().index("    time.sleep(seconds)  # the blocking call") + 1


@pytest.fixture
def worker(tmp_path):
    path = tmp_path / "blocker.py"
    path.write_text(AGENT.replace("STALL", str(BLOCK_S)))
    fake = FakeGateway(policy=lambda prompt, turn: "x")
    gateway = GatewayClient("http://fake", 30.0, transport=httpx.ASGITransport(app=fake.app))
    worker = EpisodeWorker({"blocker": str(path)}, gateway, envs_metrics(), max_concurrency=4, episode_timeout_s=60)
    return worker, path


async def _run(worker: EpisodeWorker, label: str, caplog) -> tuple[list, list]:
    # A first episode imports what episodes use: an import on the loop is a short stall of its own.
    assert (await worker.run(EpisodeRequest(agent="blocker", prompt="hi", label="warm-up", group_id="g"))).reward
    stalls = stall_counter(worker.metrics)
    dog = LoopWatchdog(worker, STALL_S, stalls)
    dog.start()
    try:
        with caplog.at_level(logging.WARNING, logger=watchdog.log.name):
            reqs = [EpisodeRequest(agent="blocker", prompt="hi", label=lab, group_id="g") for lab in ("await", label)]
            out = await asyncio.gather(*(worker.run(r) for r in reqs))  # the first waits in flight
            await asyncio.sleep(4 * dog.period)  # the watchdog sees the loop run again
    finally:
        dog.stop()
    assert [r.status for r in out] == ["ok", "ok"]
    return out, [r.getMessage() for r in caplog.records if r.name == watchdog.log.name]


async def test_a_blocking_step_is_named_by_its_line_episode_and_agent(worker, caplog):
    worker, path = worker
    out, lines = await _run(worker, "block", caplog)
    assert len(lines) == 3, lines  # the warning, one reminder, the recovery
    first, reminder, recovered = lines
    assert first.startswith("event loop blocked for ")
    holder = f"episode {out[1].trajectory_id} of agent 'blocker'"
    assert holder in first
    stack = first.split("(most recent call last):\n")[1].split("fix:")[0]
    # From the agent's first frame on: the worker, asyncio and the server are trimmed off.
    assert stack.startswith(f'  File "{path}", line {CALL_LINE}, in step\n    crunch(')
    assert f'File "{path}", line {SLEEP_LINE}, in crunch\n    time.sleep(seconds)' in stack and "asyncio" not in stack
    assert "asyncio.to_thread" in first and out[0].trajectory_id in first.split("episodes waiting: ")[1]
    assert reminder.startswith("event loop still blocked after ") and holder in reminder
    assert f'now at File "{path}", line {SLEEP_LINE}, in crunch' in reminder
    assert recovered.startswith("event loop ran again after about ") and holder in recovered
    stalls = worker.metrics.registry.get_sample_value("molt_envs_event_loop_stalls_total", {"agent": "blocker"})
    assert stalls == 1.0


async def test_an_agent_that_awaits_trips_nothing(worker, caplog):
    worker, _ = worker
    _, lines = await _run(worker, "await", caplog)
    assert lines == []
    assert worker.metrics.registry.get_sample_value("molt_envs_event_loop_stalls_total", {"agent": "blocker"}) is None
