"""The code blocks users copy from docs/algorithms.md and docs/envs.md run as written and do what the page says.
(The gateway and deploy pages' session snippets run against a real pod and gateway in
tests/integration/test_gateway_sdk.py.)"""

from __future__ import annotations

import sys
import types

import httpx
import torch

from molt.agents.gateway import GatewayClient
from molt.agents.testing import FakeGateway
from molt.algorithms import advantages as adv_module
from molt.algorithms import compute_advantages
from tests.docs_snippets import python_blocks


def test_the_custom_estimator_of_algorithms_md_registers_and_computes():
    [block] = python_blocks("algorithms.md")
    try:
        exec(compile(block, "docs/algorithms.md", "exec"), {})
        rewards = torch.tensor([1.0, 0.0, 0.5, 0.5])
        adv, ret = compute_advantages(
            "my_est",
            rewards,
            torch.ones(4, 3, dtype=torch.bool),
            group_ids=["a", "a", "b", "b"],
            rollout_ids=[f"r{i}" for i in range(4)],
        )
        torch.testing.assert_close(adv[:, 0], torch.tensor([0.5, -0.5, 0.0, 0.0]))  # reward minus its group's mean
        torch.testing.assert_close(ret, adv)
    finally:
        adv_module._ESTIMATORS.pop("my_est", None)


async def test_the_agent_of_envs_md_runs_and_grades():
    [block] = python_blocks("envs.md")
    module = types.ModuleType("docs_envs_agent")
    sys.modules[module.__name__] = module  # as the env worker imports an agent module
    try:
        exec(compile(block, "docs/envs.md", "exec"), module.__dict__)
        from molt.agents import Episode

        for answer, reward in (("so it is 42", 1.0), ("it is 41", 0.0)):
            fake = FakeGateway(policy=lambda prompt, turn, a=answer: a)
            gateway = GatewayClient("http://fake", transport=httpx.ASGITransport(app=fake.app))
            out = await module.AgentRunner().execute(Episode(prompt="6*7?", group_id="g", label="42"), gateway)
            assert out.reward == reward and out.written
            assert fake.sessions[out.trajectory_id].finish["reward"] == reward
    finally:
        del sys.modules[module.__name__]
