"""Molt's own example agent modules (vendored unchanged under tests/fixtures/molt_examples) against the
fake gateway with a scripted policy: the graders, geo3k's python tool through vLLM's qwen3 tool parser,
and the chat agents through the stock openai SDK over loopback HTTP."""

from __future__ import annotations

import sys
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


async def test_geo3k_env_runs_its_python_tool_and_feeds_the_output_back(model_path):
    turns = {1: TOOL_CALL, 2: "<answer>42</answer>"}
    fake = FakeGateway(policy=lambda prompt, turn: turns[turn])
    gw = GatewayClient("http://fake", transport=httpx.ASGITransport(app=fake.app))
    out = await _runner("geo3k").execute(
        Episode(prompt="6*7?", group_id="g", label={"ground_truth": "42"}, max_new_tokens=256), gw
    )
    s = fake.sessions[out.trajectory_id]
    assert out.turns == 2 and out.reward == 1.0  # turn 1: tool call, reward 0; turn 2: correct answer
    assert s.action_texts() == [TOOL_CALL, "<answer>42</answer>"]
    assert "<tool_response>\n42\n" in s.masked_texts()[1]  # the sandboxed run's stdout
    assert s.finish["info"] == {"geo3k_tool_call_total": 1.0, "geo3k_correct": 1.0, "turn_index": 2.0}


async def test_chat_agents_use_sampling_params_by_attribute_and_the_tool(model_path, served_fake):
    turns = {1: TOOL_CALL, 2: "\\boxed{42}"}
    fake = FakeGateway(policy=lambda prompt, turn: turns[turn])
    gw = GatewayClient(served_fake(fake))
    sp = {"temperature": 0.9, "max_tokens": 200}
    out = await _runner("chat_geo3k").execute(
        Episode(prompt="6*7?", group_id="g", label={"ground_truth": "42"}, sampling_params=sp), gw
    )
    s = fake.sessions[out.trajectory_id]
    assert out.reward == 1.0 and s.finish["info"] == {
        "geo3k_tool_call_total": 1.0,
        "geo3k_correct": 1.0,
        "turn_index": 2.0,
    }
    assert "<|user|><tool_response>\n42\n" in s.text()
    fake.policy = lambda prompt, turn: "\\boxed{7}"
    out = await _runner("chat_minimal").execute(
        Episode(prompt="3+4?", group_id="g", label="7", sampling_params=sp), gw
    )
    assert out.reward == 1.0 and fake.sessions[out.trajectory_id].finish["info"] == {"math_exact": 1.0}
    await gw.aclose()
    assert "molt_agent_molt_ex_chat_minimal" in sys.modules
