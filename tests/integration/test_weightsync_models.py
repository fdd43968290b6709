"""Weight sync into real vLLM for MoE (with a frozen router kept on the pod) and an untied head.

Own module: one in-process vLLM engine at a time, each test starts and closes its own.
"""

from __future__ import annotations

import pytest
import torch
from rollout_testlib import PROMPT, max_abs_diff, tiny_settings

from molt.weightsync.check import probe_check, prompt_logprobs
from molt.weightsync.manifest import hf_adapter
from molt.weightsync.pusher import WeightPusher
from molt.weightsync.server import start_weightsync_server
from services.rollout.engine import RolloutEngine

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(300), pytest.mark.vllm]
TOL = 1e-4


def _hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


async def _sync_and_compare(model_a, trainer: torch.nn.Module, frozen=()):
    engine = RolloutEngine(tiny_settings(model_a))
    await engine.start()
    server, port = await start_weightsync_server(engine, "127.0.0.1", 0)
    target = f"127.0.0.1:{port}"
    pusher = WeightPusher([target], frozen=frozen, bucket_bytes=512 << 10, to_hf=hf_adapter(trainer))
    try:
        state = {n: t for n, t in trainer.state_dict().items() if n not in set(frozen)}
        report = await pusher.push_async(state, version=3, check=probe_check(trainer, max_abs_diff=TOL))
        pod = report.pods[target]
        assert pod["promoted"] and pod["version"] == 3 == engine.policy_version
        assert pod["untouched"] == []  # kept names are deliberate, not reported
        assert report.kept == sorted(frozen)
        got = await engine.prompt_logprobs(PROMPT)
        assert max_abs_diff(got, prompt_logprobs(trainer, PROMPT)) < TOL
    finally:
        await pusher._pods()[0].close()
        await server.stop(0)
        await engine.close()


async def test_moe_with_frozen_router(tiny_qwen3_moe, tiny_qwen3_moe_b):
    """Experts are re-packed on the CPU backend; the router is frozen: not sent, the pod keeps its own."""
    trainer, initial = _hf(tiny_qwen3_moe_b), _hf(tiny_qwen3_moe)
    frozen = sorted(n for n in trainer.state_dict() if n.endswith("mlp.gate.weight"))
    assert frozen, "expected MoE router weights named *.mlp.gate.weight"
    with torch.no_grad():  # the trainer's router never moved from the initial weights the pod loaded
        for name in frozen:
            trainer.get_parameter(name).copy_(initial.get_parameter(name))
    await _sync_and_compare(tiny_qwen3_moe, trainer, frozen)


async def test_untied_lm_head(tiny_llama_untied, tiny_llama_untied_b):
    await _sync_and_compare(tiny_llama_untied, _hf(tiny_llama_untied_b))


async def test_an_fp32_trainer_sends_a_bf16_pod_bf16(tiny_qwen3, tiny_qwen3_b):
    """A pod serving bf16 (``--vllm.dtype bfloat16`` on an fp32 checkpoint) reports it, the trainer's fp32 weights
    travel as bf16 (half the bytes), and the pod serves exactly what loading the fp32 tensors themselves gives it."""
    settings = tiny_settings(tiny_qwen3)
    settings.vllm.dtype = "bfloat16"
    engine = RolloutEngine(settings)
    await engine.start()
    server, port = await start_weightsync_server(engine, "127.0.0.1", 0)
    target = f"127.0.0.1:{port}"
    pusher = WeightPusher([target])
    try:
        assert engine.serving_dtype == "bfloat16"
        state = _hf(tiny_qwen3_b).state_dict()
        report = await pusher.push_async(state, version=1)
        assert report.pods[target]["promoted"]
        fp32_bytes = sum(t.numel() * 4 for n, t in state.items() if n != "lm_head.weight")
        assert report.bytes < 0.55 * fp32_bytes
        pushed = await engine.prompt_logprobs(PROMPT)
        await engine.apply_weights({n: t for n, t in state.items() if n != "lm_head.weight"}, 2, [])
        assert await engine.prompt_logprobs(PROMPT) == pushed
    finally:
        await pusher._pods()[0].close()
        await server.stop(0)
        await engine.close()
