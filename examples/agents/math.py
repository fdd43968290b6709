"""Single-turn math with a verifiable grader (Env path).

The model answers once; the reward is 1.0 when the answer's final number (``\\boxed{...}`` if present,
else the last number in the text) equals the label, else 0.0. The label is the number itself or
``{"ground_truth": ...}``.

    python -m services.envs --agent math=examples/agents/math.py --gateway.url http://127.0.0.1:8000
"""

from __future__ import annotations

import re

from molt.agents import Env, Result, StepEnvRunner

_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:/\d+)?")


def extract_answer(text: str) -> str | None:
    """The boxed answer if any, else the last number in ``text``."""
    boxed = _BOXED.findall(text)
    if boxed:
        return boxed[-1].strip()
    numbers = _NUMBER.findall(text.replace(",", ""))
    return numbers[-1] if numbers else None


def _as_number(text: str) -> float | None:
    try:
        if "/" in text:
            num, den = text.split("/", 1)
            return float(num) / float(den)
        return float(text)
    except (ValueError, ZeroDivisionError):
        return None


def grade(action_text: str, label) -> float:
    """1.0 if the answer in ``action_text`` equals the label (numerically when both are numbers)."""
    truth = label.get("ground_truth") if isinstance(label, dict) else label
    answer = extract_answer(action_text)
    if answer is None or truth is None:
        return 0.0
    a, b = _as_number(answer), _as_number(str(truth).strip())
    if a is not None and b is not None:
        return float(abs(a - b) < 1e-6)
    return float(answer == str(truth).strip())


class MathEnv(Env):
    async def step(self, state):
        return Result(reward=grade(state["action_text"], state["label"]))


class AgentRunner(StepEnvRunner):
    def __init__(self):
        super().__init__(MathEnv)
