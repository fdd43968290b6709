"""Verifiable reward for the `smollm2` recipe: short sums, answered with just the number.

Reward 1.0 when the reply's first number equals the label, plus 0.2 when the reply is nothing but
that number (format following). A Molt-style module: it runs unchanged under Molt.
"""

import re

from molt.agents import Env, Result, StepEnvRunner

_NUMBER = re.compile(r"-?\d+")


class ArithmeticEnv(Env):
    async def step(self, state):
        text = state["action_text"].replace("<|im_end|>", "").strip()
        found = _NUMBER.search(text)
        correct = bool(found) and found.group() == str(state["label"]).strip()
        exact = correct and text.rstrip(".") == found.group()
        return Result(reward=float(correct) + 0.2 * float(exact), score=float(correct), terminated=True,
                      info={"correct": float(correct), "exact_format": float(exact)})


class AgentRunner(StepEnvRunner):
    def __init__(self):
        super().__init__(ArithmeticEnv)
