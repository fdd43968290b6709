"""The built-in agent of on-policy distillation (``--algo.advantage.estimator on_policy_distill``).

Distillation's training signal is the per-token reverse KL to the teacher (the reference model), which the
estimator computes; the episode only has to sample one completion of the prompt. This module is that episode:
one turn, reward 0.0 (the contract wants a number; the estimator ignores it). ``molt train-rl`` serves it when
on_policy_distill is set without ``--train.agent_path``, as Molt selects its own; pass an agent module to
distill a multi-turn or tool-using distribution instead.
"""

from __future__ import annotations

from molt.agents.base import Result
from molt.agents.env import Env, StepEnvRunner


class DistillationEnv(Env):
    async def step(self, state) -> Result:
        return Result(reward=0.0)  # terminated: one completion per episode


class AgentRunner(StepEnvRunner):
    def __init__(self) -> None:
        super().__init__(DistillationEnv)
