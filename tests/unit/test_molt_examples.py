"""Molt's own example agent modules (vendored unchanged under tests/fixtures/molt_examples) against the
fake gateway with a scripted policy: the graders, geo3k's python tool through vLLM's qwen3 tool parser,
and the chat agents through the stock openai SDK over loopback HTTP.

Episodes whose agent calls Molt's python tool run in a freshly spawned process: the tool starts its interpreter
with a preexec_fn, and a fork of this test worker runs Python in the child, where the torch thread-local state
other tests left (a gloo process group in the DTensor cache) can deadlock at fork. An env worker holds none.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import httpx
import pytest

from molt.agents import Episode
from molt.agents.base import load_agent_runner
from molt.agents.gateway import GatewayClient
from molt.agents.testing import FakeGateway

MOLT_EXAMPLES = Path(__file__).resolve().parents[1] / "fixtures" / "molt_examples" / "agents"
TOOL_CALL = (
    "let me check\n<tool_call>\n<function=python_executor>\n<parameter=code>\nprint(6 * 7)\n"
    "</parameter>\n</function>\n</tool_call>"
)


@pytest.fixture
def model_path(tiny_qwen3, monkeypatch):
    monkeypatch.setenv("MODEL_PATH", str(tiny_qwen3))  # Molt's geo3k modules build the tool parser from it


def _runner(name: str):
    return load_agent_runner(MOLT_EXAMPLES / f"{name}.py", f"molt_ex_{name}")


def _episode_here(name: str, url: str, episode: dict, env: dict[str, str]) -> tuple[str, float, int, bool]:
    """In the spawned process: (trajectory id, reward, turns, whether the module is registered under its name)."""
    import os

    os.environ.update(env)

    async def go():
        gw = GatewayClient(url)
        try:
            return await _runner(name).execute(Episode(**episode), gw)
        finally:
            await gw.aclose()

    out = asyncio.run(go())
    return out.trajectory_id, out.reward, out.turns, f"molt_agent_molt_ex_{name}" in sys.modules


@pytest.fixture(scope="module")
def spawned():
    """One spawned process for the module's episodes: it is fresh from this worker's torch state either way,
    and sharing it pays the interpreter start and the agents' imports (vLLM's tool parser) once."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        yield pool


async def _episode_in_spawned_process(pool, name: str, url: str, **episode) -> tuple[str, float, int, bool]:
    import os

    env = {k: v for k, v in os.environ.items() if k == "MODEL_PATH"}
    return await asyncio.get_running_loop().run_in_executor(pool, _episode_here, name, url, episode, env)


@pytest.fixture
def served_fake():
    from tests.integration.envs_testlib import Served

    servers = []

    def serve(fake: FakeGateway) -> str:
        servers.append(Served(fake.app, "fake-gateway"))
        return servers[-1].url

    yield serve
    for s in servers:
        s.stop()


async def test_math_env_grades_a_boxed_answer_and_reduces_tensor_info():
    fake = FakeGateway(policy=lambda prompt, turn: "so it is \\boxed{4}")
    gw = GatewayClient("http://fake", transport=httpx.ASGITransport(app=fake.app))
    out = await _runner("math").execute(Episode(prompt="2+2?", group_id="g", label="4"), gw)
    assert out.reward == 1.0 and out.turns == 1
    assert fake.sessions[out.trajectory_id].finish["info"] == {"math_exact": 1.0, "missing_answer": 0.0}


async def test_geo3k_env_runs_its_python_tool_and_feeds_the_output_back(model_path, served_fake, spawned):
    turns = {1: TOOL_CALL, 2: "<answer>42</answer>"}
    fake = FakeGateway(policy=lambda prompt, turn: turns[turn])
    tid, reward, n_turns, _ = await _episode_in_spawned_process(
        spawned,
        "geo3k",
        served_fake(fake),
        prompt="6*7?",
        group_id="g",
        label={"ground_truth": "42"},
        max_new_tokens=256,
    )
    s = fake.sessions[tid]
    assert n_turns == 2 and reward == 1.0  # turn 1: tool call, reward 0; turn 2: correct answer
    assert s.action_texts() == [TOOL_CALL, "<answer>42</answer>"]
    assert "<tool_response>\n42\n" in s.masked_texts()[1]  # the sandboxed run's stdout
    assert s.finish["info"] == {"geo3k_tool_call_total": 1.0, "geo3k_correct": 1.0, "turn_index": 2.0}


async def test_chat_agents_use_sampling_params_by_attribute_and_the_tool(model_path, served_fake, spawned):
    turns = {1: TOOL_CALL, 2: "\\boxed{42}"}
    fake = FakeGateway(policy=lambda prompt, turn: turns[turn])
    url = served_fake(fake)
    sp = {"temperature": 0.9, "max_tokens": 200}
    tid, reward, _, _ = await _episode_in_spawned_process(
        spawned, "chat_geo3k", url, prompt="6*7?", group_id="g", label={"ground_truth": "42"}, sampling_params=sp
    )
    s = fake.sessions[tid]
    assert reward == 1.0 and s.finish["info"] == {
        "geo3k_tool_call_total": 1.0,
        "geo3k_correct": 1.0,
        "turn_index": 2.0,
    }
    assert "<|user|><tool_response>\n42\n" in s.text()
    fake.policy = lambda prompt, turn: "\\boxed{7}"
    tid, reward, _, registered = await _episode_in_spawned_process(
        spawned, "chat_minimal", url, prompt="3+4?", group_id="g", label="7", sampling_params=sp
    )
    assert reward == 1.0 and fake.sessions[tid].finish["info"] == {"math_exact": 1.0}
    assert registered
