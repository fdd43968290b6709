"""``Env.close``: Molt's StepEnvRunner closes each episode's env once it is over, whatever ended it, so an env
that holds a process (a game engine, as Molt's AlfWorld agent starts one per episode) never leaks it. Checked
with a real child process per episode, through the gateway's session API (a fake gateway) and in process."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from types import SimpleNamespace

import httpx
import pytest

from molt.agents import Env, Episode, Result, StepEnvRunner
from molt.agents.gateway import GatewayClient
from molt.agents.testing import FakeGateway
from tests.unit.test_molt_parity_agents import _CharTokenizer, _ScriptedEngine


class _GameEnv(Env):
    """Starts a child process in reset, as an env with a game engine does; closes itself on its last step, as
    Molt's AlfWorld env does, so the runner's close must be safe to repeat."""

    procs: list[subprocess.Popen] = []
    closes = 0
    fail_step = False
    step_s = 0.0  # how long a step waits on the game engine

    async def reset(self, state):
        self.proc: subprocess.Popen | None = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        _GameEnv.procs.append(self.proc)
        return state

    async def step(self, state):
        if _GameEnv.fail_step:
            raise RuntimeError("the game engine crashed")
        await asyncio.sleep(_GameEnv.step_s)
        done = "win" in state["action_text"]
        if done:
            await self.close()
        return Result(reward=1.0 if done else 0.0, observation=" [look]", terminated=done)

    async def close(self):
        _GameEnv.closes += 1
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


@pytest.fixture(autouse=True)
def _fresh():
    _GameEnv.procs, _GameEnv.closes, _GameEnv.fail_step, _GameEnv.step_s = [], 0, False, 0.0
    yield
    for p in _GameEnv.procs:  # only what this test started
        if p.poll() is None:
            p.kill()
            p.wait()


def _run(policy, max_length: int = 400, cancel_after_s: float | None = None):
    fake = FakeGateway(policy=policy)
    gateway = GatewayClient("http://fake", transport=httpx.ASGITransport(app=fake.app))
    episode = Episode(prompt="room", group_id="g", max_length=max_length, sampling_params={"max_tokens": 8})

    async def go():
        task = asyncio.ensure_future(StepEnvRunner(_GameEnv).execute(episode, gateway))
        if cancel_after_s is None:
            return await task
        await asyncio.sleep(cancel_after_s)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    return asyncio.run(go())


@pytest.mark.parametrize("how", ["won", "out of context", "step raised", "cancelled"])
def test_the_env_is_closed_once_the_episode_is_over_however_it_ended(how):
    if how == "won":
        result = _run(lambda text, turn: "win" if turn == 3 else "go")
        assert result.turns == 3 and result.reward == 1.0
    elif how == "out of context":
        result = _run(lambda text, turn: "go", max_length=40)  # never wins: the session's budget ends it
        assert result.truncated and result.reward == 0.0
    elif how == "step raised":
        _GameEnv.fail_step = True
        with pytest.raises(RuntimeError, match="the game engine crashed"):  # the episode's own error, not masked
            _run(lambda text, turn: "go")
    else:
        _GameEnv.step_s = 0.05  # the worker drains or a lease expires while a step waits on the game
        _run(lambda text, turn: "go", max_length=100_000, cancel_after_s=0.5)
    [proc] = _GameEnv.procs
    assert proc.poll() is not None, "the env's process outlived its episode"
    assert _GameEnv.closes == (2 if how == "won" else 1)


class _SyncCloseEnv(Env):
    closed = 0

    async def step(self, state):
        return Result(reward=0.5, terminated=True)

    def close(self):  # type: ignore[override]  # a plain def, as some envs write it
        _SyncCloseEnv.closed += 1
        raise OSError("already gone")


def test_a_plain_def_close_is_called_and_its_failure_does_not_lose_the_episode(caplog):
    fake = FakeGateway(policy=lambda text, turn: "x")
    gateway = GatewayClient("http://fake", transport=httpx.ASGITransport(app=fake.app))
    result = asyncio.run(StepEnvRunner(_SyncCloseEnv).execute(Episode(prompt="p", group_id="g"), gateway))
    assert result.reward == 0.5 and result.written and _SyncCloseEnv.closed == 1
    assert "_SyncCloseEnv.close failed" in caplog.text


def test_molts_in_process_form_closes_the_env_too():
    params = SimpleNamespace(max_tokens=8, min_tokens=0, temperature=1.0, top_p=1.0, top_k=-1, logprobs=None)
    engine = _ScriptedEngine(["win"])
    asyncio.run(StepEnvRunner(_GameEnv).execute("room", "label", params, 100, _CharTokenizer(), engine))
    [proc] = _GameEnv.procs
    assert proc.poll() is not None and _GameEnv.closes == 2
