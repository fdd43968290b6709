"""A multi-turn tool env: the model runs Python in the sandbox until it answers (Env path).

Each turn the model either writes code in a ```python block, which runs in ``molt.agents.sandbox``
(an OS-isolated bubblewrap child: no network, read-only fs, rlimits) and whose stdout/stderr comes back as the next
observation, or it answers with ``<answer>...</answer>``, which is graded like examples/agents/math.py
and ends the episode. Tool outputs are feedback: appended after the action and masked out of the loss.
``MAX_AGENT_TURNS`` (default 5) caps the turns; the sandbox reads ``PYTHON_EXECUTOR_TIMEOUT`` /
``PYTHON_EXECUTOR_MEM_BYTES`` / ``PYTHON_EXECUTOR_OUTPUT_CHARS``.

The feedback is wrapped as a ChatML user turn (Qwen-style templates, as the tiny test models use);
override ``ToolEnv.feedback`` for another template.

    python -m services.envs --agent tools=examples/agents/tool_env.py --gateway.url http://127.0.0.1:8000
"""

from __future__ import annotations

import os
import re

from molt.agents import Env, Result, StepEnvRunner
from molt.agents.sandbox import run_python

CODE_RE = re.compile(r"```python\s*\n(.*?)```", re.S)
ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.S)
NO_CODE = "No code found: write Python in a ```python block, or answer with <answer>...</answer>."


def _number(text: str) -> float | None:
    try:
        return float(text.strip().replace(",", ""))
    except ValueError:
        return None


def grade(answer: str, label) -> float:
    truth = label.get("ground_truth") if isinstance(label, dict) else label
    if truth is None:
        return 0.0
    a, b = _number(answer), _number(str(truth))
    if a is not None and b is not None:
        return float(abs(a - b) < 1e-6)
    return float(answer.strip() == str(truth).strip())


class ToolEnv(Env):
    def __init__(self):
        super().__init__()
        self.turns = 0
        self.tool_calls = 0
        self.max_turns = int(os.environ.get("MAX_AGENT_TURNS", "5"))

    def extract_code(self, action_text: str) -> str | None:
        blocks = CODE_RE.findall(action_text)
        return blocks[-1] if blocks else None

    def feedback(self, tool_output: str) -> str:
        return f"\n<|im_start|>user\n<output>\n{tool_output}\n</output><|im_end|>\n<|im_start|>assistant\n"

    async def step(self, state):
        self.turns += 1
        action = state["action_text"]
        answer = ANSWER_RE.search(action)
        if answer:
            return Result(reward=grade(answer.group(1), state["label"]), info={"tool_calls": self.tool_calls})
        code = self.extract_code(action)
        if code is None:
            output = NO_CODE
        else:
            self.tool_calls += 1
            output = (await run_python(code)).as_observation()
        return Result(
            reward=0.0,
            observation=self.feedback(output),
            terminated=self.turns >= self.max_turns,
            info={"tool_calls": self.tool_calls},
        )


class AgentRunner(StepEnvRunner):
    def __init__(self):
        super().__init__(ToolEnv)
