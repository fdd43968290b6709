"""Verifiable reward for the `smollm2` recipe: short sums, answered with just the number.

Reward 1.0 when the reply's last number equals the label (the model often restates the question:
"12 + 9 is 21"), plus 0.2 when the reply is nothing but that number (format following). A Molt-style
module: it runs unchanged under Molt.
"""

import re

from molt.agents import Env, Result, StepEnvRunner

_NUMBER = re.compile(r"-?\d+")


class ArithmeticEnv(Env):
    async def step(self, state):
        text = state["action_text"].replace("<|im_end|>", "").strip()
        numbers = _NUMBER.findall(text)
        correct = bool(numbers) and numbers[-1] == str(state["label"]).strip()
        exact = correct and text.rstrip(".") == numbers[-1]
        return Result(
            reward=float(correct) + 0.2 * float(exact),
            score=float(correct),
            terminated=True,
            info={"correct": float(correct), "exact_format": float(exact)},
        )


class AgentRunner(StepEnvRunner):
    def __init__(self):
        super().__init__(ArithmeticEnv)
