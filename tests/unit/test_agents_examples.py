"""The example agents' graders and the tool env's loop, against the fake gateway (no model)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from molt.agents import Episode
from molt.agents.base import load_agent_runner
from molt.agents.gateway import GatewayClient
from molt.agents.testing import FakeGateway

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "agents"


def _module(name):
    import sys

    load_agent_runner(EXAMPLES / f"{name}.py", f"ex_{name}")
    return sys.modules[f"molt_agent_ex_{name}"]


@pytest.mark.parametrize(
    "text, label, reward",
    [
        ("so the answer is \\boxed{12}", "12", 1.0),
        ("7 then 12.0", {"ground_truth": 12}, 1.0),
        ("1/2", "0.5", 1.0),
        ("no number", "3", 0.0),
        ("3, then 4", "3", 0.0),
        ("1,234", "1234", 1.0),
    ],
)
def test_math_grade(text, label, reward):
    assert _module("math").grade(text, label) == reward


def test_judge_parse_and_chat_grade():
    judge = _module("judge")
    assert judge.parse_score("Score: 7") == 0.7 and judge.parse_score("score:12") == 1.0
    assert judge.parse_score("great answer") == 0.0
    assert _module("chat_minimal").grade("Paris, France", "paris") == 1.0


async def test_tool_env_runs_code_in_the_sandbox_and_masks_its_output():
    turns = {
        1: "let me compute\n```python\nprint(6 * 7)\n```",
        2: "```python\nimport socket\nsocket.create_connection(('127.0.0.1', 9))\n```",
        3: "<answer>42</answer>",
    }
    fake = FakeGateway(policy=lambda prompt, turn: turns[turn])
    runner = load_agent_runner(EXAMPLES / "tool_env.py", "ex_tools")
    gw = GatewayClient("http://fake", transport=httpx.ASGITransport(app=fake.app))
    out = await runner.execute(Episode(prompt="What is 6*7?", group_id="g", label="42", max_new_tokens=256), gw)
    s = fake.sessions[out.trajectory_id]
    assert out.reward == 1.0 and out.turns == 3 and s.finish["info"] == {"tool_calls": 2.0}
    assert s.action_texts() == [turns[1], turns[2], turns[3]]
    masked = s.masked_texts()
    assert len(masked) == 3 and "<output>\n42\n</output>" in masked[1]
    assert "ConnectionRefusedError" in masked[2]  # the sandbox's own loopback: nothing of the host listens
