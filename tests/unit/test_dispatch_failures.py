"""Episodes that fail for good: tolerated while some succeed, a stop with the env's error when every one fails.

The env workers are the real app (services.envs) over the in-memory fake gateway; the dispatcher is the trainer's.
"""

from __future__ import annotations

import textwrap

import httpx
import pytest

from molt.agents.testing import FakeGateway
from molt.bus.memory import MemoryTrajectoryQueue
from molt.config import parse_settings
from services.envs.app import build_app
from services.envs.config import EnvsSettings
from services.trainer.config import EnvsConfig, RolloutConfig, TrainerSettings
from services.trainer.controller import Controller
from services.trainer.dispatch import DispatchError, EpisodeDispatcher
from services.trainer.metrics import trainer_metrics

AGENT = textwrap.dedent("""
    from molt.agents import Env, Result, StepEnvRunner

    class LookupEnv(Env):
        async def step(self, state):
            if state["label"] == "broken":
                raise KeyError("answer")
            if state["label"] == "leaky":
                raise RuntimeError("gateway refused key sk-test-0123456789")
            return Result(reward=1.0)

    class AgentRunner(StepEnvRunner):
        def __init__(self):
            super().__init__(LookupEnv)
""")

SYNC_STEP = textwrap.dedent("""
    from molt.agents import Env, Result, StepEnvRunner

    class SyncEnv(Env):
        def step(self, state):
            return Result(reward=1.0)

    class AgentRunner(StepEnvRunner):
        def __init__(self):
            super().__init__(SyncEnv)
""")


def _worker(tmp_path, text: str = AGENT, **gateway):
    path = tmp_path / "agent.py"
    path.write_text(text)
    fake = FakeGateway(policy=lambda prompt, turn: "yes")
    settings = EnvsSettings(agent=[f"lookup={path}"], gateway={"url": "http://fake", **gateway})
    return build_app(settings, gateway_transport=httpx.ASGITransport(app=fake.app))


def _dispatcher(tmp_path, **envs) -> EpisodeDispatcher:
    cfg = EnvsConfig(urls=["http://w1"], agent="lookup", retry_backoff_s=0.001, **envs)
    dispatcher = EpisodeDispatcher(cfg, RolloutConfig(), 256)
    dispatcher.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=_worker(tmp_path)))
    return dispatcher


def _body(label: str, i: int = 0, **extra) -> dict:
    return {"agent": "lookup", "prompt": "q", "label": label, "group_id": "g", "sample_index": i, **extra}


async def test_an_env_failing_every_episode_stops_dispatch_with_its_error_and_the_flag(tmp_path):
    d = _dispatcher(tmp_path, max_retries=1, max_consecutive_failures=3)
    for i in range(2):  # two failed for good (2 tries each): tolerated
        assert (await d.run_episode(_body("broken", i)))["error"] == "KeyError: 'answer'"
    with pytest.raises(DispatchError) as err:
        await d.run_episode(_body("broken", 2))
    message = str(err.value)
    assert message.startswith("3 episodes in a row failed for good (2 tries each, --envs.max_retries 1)")
    assert "episode g/2 of agent 'lookup' on http://w1: KeyError: 'answer'" in message
    assert "--envs.max_consecutive_failures 3" in message
    await d.close()


async def test_a_written_episode_resets_the_count_and_eval_failures_never_count(tmp_path):
    d = _dispatcher(tmp_path, max_retries=0, max_consecutive_failures=3)
    for label in ("broken", "broken", "ok", "broken", "broken"):  # a flaky env: never 3 failures in a row
        await d.run_episode(_body(label))
    await d.run_episode(_body("broken", eval=True))
    assert (d.failed, d.consecutive_failures) == (5, 2)
    await d.close()


async def test_zero_never_stops(tmp_path):
    d = _dispatcher(tmp_path, max_retries=0, max_consecutive_failures=0)
    for i in range(5):
        assert (await d.run_episode(_body("broken", i)))["status"] == "failed"
    assert d.consecutive_failures == 5
    await d.close()


async def test_the_worker_masks_its_own_credentials_in_the_reported_error(tmp_path):
    app = _worker(tmp_path, api_key="sk-test-0123456789")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://w") as client:
        r = await client.post("/v1/episodes:run", json=_body("leaky"))
    assert r.json()["error"] == "RuntimeError: gateway refused key ***"


def test_a_sync_step_is_refused_when_the_worker_loads_the_module(tmp_path):
    with pytest.raises(ValueError, match=r"SyncEnv\.step must be async def"):
        _worker(tmp_path, SYNC_STEP)


class _Prompts:
    def __len__(self):
        return 2

    def get(self, position):
        return f"prompt {position}"


class _FailingDispatcher:
    """Every episode failed for good: nothing is written (what EpisodeDispatcher reports for a broken env)."""

    def __init__(self):
        self.failed, self.last_failure = 0, None

    async def run_group(self, prompt, group_id, samples):
        self.failed += len(samples)
        self.last_failure = f"episode {group_id}/0 of agent 'lookup' on http://w1: KeyError: 'answer'"
        return []

    async def close(self):
        pass


async def test_a_dataset_that_ran_out_with_every_episode_failed_is_an_error_not_a_finished_run():
    s = parse_settings(
        TrainerSettings,
        [
            *("--actor.model_name_or_path", "m", "--rollout.n_samples_per_prompt", "2"),
            *("--rollout.batch_size", "1", "--train.read_block_s", "0.01"),
        ],
        environ={},
    )
    c = Controller(s, MemoryTrajectoryQueue(), trainer_metrics(), dataset=_Prompts(), dispatcher=_FailingDispatcher())
    c.start_dispatch()
    try:
        with pytest.raises(DispatchError) as err:
            await c.next_batch(1)
    finally:
        await c.close()
    assert str(err.value).startswith("the dataset ran out with no step trained: 4 episodes failed for good")
    assert "KeyError: 'answer'" in str(err.value)
