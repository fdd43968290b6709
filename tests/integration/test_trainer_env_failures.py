"""A reward Env that raises on every episode stops the real trainer with a non-zero exit and the Env's error.

The env worker is the real app (services.envs) on a loopback port, its gateway the in-memory fake (the Env fails
before anything would be written); the trainer is ``python -m services.trainer`` in dispatch mode over Redis.
"""

from __future__ import annotations

import subprocess
import textwrap

import httpx
import pytest
from envs_testlib import Served

from molt.agents.testing import FakeGateway
from services.envs.app import build_app
from services.envs.config import EnvsSettings
from tests.integration.trainer_testlib import ROOT, delete_stream, dispatch_flags, env, trainer_cmd

pytestmark = [pytest.mark.redis, pytest.mark.timeout(300)]

BROKEN = textwrap.dedent("""
    from molt.agents import Env, StepEnvRunner

    class LookupEnv(Env):
        async def step(self, state):
            return {"answer": 1}["answr"]  # the bug: every episode raises KeyError

    class AgentRunner(StepEnvRunner):
        def __init__(self):
            super().__init__(LookupEnv)
""")


@pytest.fixture
def broken_worker(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text(BROKEN)
    fake = FakeGateway(policy=lambda prompt, turn: "42")
    settings = EnvsSettings(agent=[f"default={path}"], gateway={"url": "http://fake"})
    worker = Served(build_app(settings, gateway_transport=httpx.ASGITransport(app=fake.app)), "env-worker")
    yield worker.url
    worker.stop()


def _train(tmp_path, model, redis_url, stream, worker, prompts, *flags) -> subprocess.CompletedProcess:
    cmd = [
        *trainer_cmd(),
        *dispatch_flags(tmp_path, prompts, model, redis_url, stream, worker),
        *("--rollout.n_samples_per_prompt", "2", "--rollout.batch_size", "2", "--train.batch_size", "4"),
        *("--envs.retry_backoff_s", "0.05", "--fsdp.strategy", "torch", "--server.port", "0"),
        *("--ckpt.path", str(tmp_path / "ckpt")),
        *flags,
    ]
    try:
        return subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=200)
    finally:
        delete_stream(redis_url, stream)


def test_an_env_failing_every_episode_stops_the_run_with_its_error(
    broken_worker, tiny_qwen3, redis_url, stream_name, tmp_path
):
    proc = _train(
        tmp_path,
        tiny_qwen3,
        redis_url,
        stream_name,
        broken_worker,
        16,
        *("--envs.max_retries", "1", "--envs.max_consecutive_failures", "6"),
    )
    assert proc.returncode != 0, proc.stderr[-3000:]
    line = next((ln for ln in proc.stderr.splitlines() if "stopping the run:" in ln), None)
    assert line is not None, proc.stderr[-3000:]
    assert "6 episodes in a row failed for good (2 tries each, --envs.max_retries 1)" in line
    assert "of agent 'default' on " + broken_worker in line and "KeyError: 'answr'" in line
    assert "--envs.max_consecutive_failures 6" in line
    assert "done:" not in proc.stderr


def test_a_dataset_run_out_with_every_episode_failed_never_exits_zero(
    broken_worker, tiny_qwen3, redis_url, stream_name, tmp_path
):
    proc = _train(tmp_path, tiny_qwen3, redis_url, stream_name, broken_worker, 2, "--envs.max_retries", "0")
    assert proc.returncode != 0, proc.stderr[-3000:]
    assert "the dataset ran out with no step trained: 4 episodes failed for good" in proc.stderr
    assert "KeyError: 'answr'" in proc.stderr and "done:" not in proc.stderr
