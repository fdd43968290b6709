"""Toy reward for the `tiny` recipe: the fraction of digit characters in the reply.

A random-init model emits digits rarely; the reward is dense (every token moves it), so GRPO
raises it within a few minutes on 2 cores. A Molt-style module: it runs unchanged under Molt.
"""

from molt.agents import Env, Result, StepEnvRunner


class DigitsEnv(Env):
    async def step(self, state):
        text = state["action_text"].replace("<|im_end|>", "")
        chars = [c for c in text if not c.isspace()]
        reward = sum(c.isdigit() for c in chars) / len(chars) if chars else 0.0
        return Result(reward=reward, terminated=True, info={"reply_chars": float(len(chars))})


class AgentRunner(StepEnvRunner):
    def __init__(self):
        super().__init__(DigitsEnv)
