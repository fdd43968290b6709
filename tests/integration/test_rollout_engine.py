"""RolloutEngine on real vLLM (tiny models, fp32): logprob parity, atomic weight updates, versions.

This is the surface the gRPC weight-sync receiver calls: apply_weights, expected_parameters,
policy_version and prompt_logprobs.
"""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio
from rollout_testlib import PROMPT, hf_token_logprobs, max_abs_diff, tiny_settings

from services.rollout.checkpoint import load_tensors, read_header, safetensors_files
from services.rollout.engine import RolloutEngine
from services.rollout.params import RolloutInputError

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(300)]
TOL = 1e-4


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def dense(tiny_qwen3):
    engine = RolloutEngine(tiny_settings(tiny_qwen3))
    await engine.start()
    yield engine
    await engine.close()


async def _assert_parity(engine: RolloutEngine, model, n: int = 2, max_tokens: int = 8) -> None:
    result = await engine.generate(PROMPT, {"n": n, "max_tokens": max_tokens, "temperature": 1.0, "seed": 7})
    assert len(result.samples) == n
    for s in result.samples:
        assert len(s.token_ids) == len(s.logprobs) > 0
        assert s.policy_version == result.policy_version == engine.policy_version
        assert max_abs_diff(s.logprobs, hf_token_logprobs(model, PROMPT, s.token_ids)) < TOL
    probe = await engine.prompt_logprobs(PROMPT)
    assert max_abs_diff(probe, hf_token_logprobs(model, PROMPT[:1], PROMPT[1:])) < TOL


async def test_dense_generate_and_probe_match_transformers(dense, tiny_qwen3):
    await _assert_parity(dense, tiny_qwen3)
    result = await dense.generate(PROMPT, {"n": 3, "max_tokens": 5, "seed": 1})
    assert [s.finish_reason for s in result.samples] == ["length"] * 3
    assert result.policy_version == 0


async def test_expected_parameters_come_from_the_checkpoint(dense, tiny_qwen3):
    expected = dense.expected_parameters()
    header = read_header(safetensors_files(tiny_qwen3)[0])
    assert set(expected) == set(header)
    assert "lm_head.weight" not in expected  # tied: the engine reuses the embedding
    assert expected["model.embed_tokens.weight"] == (tuple(header["model.embed_tokens.weight"]["shape"]), "float32")


async def test_bad_weights_are_refused_before_anything_changes(dense, tiny_qwen3_b):
    tensors = load_tensors(tiny_qwen3_b)
    before = dense.policy_version
    with pytest.raises(ValueError, match="missing"):
        await dense.apply_weights({k: v for k, v in tensors.items() if "layers.0." not in k}, before + 1)
    with pytest.raises(ValueError, match="does not have"):
        await dense.apply_weights({**tensors, "model.bogus.weight": tensors["model.norm.weight"]}, before + 1)
    name = "model.norm.weight"
    with pytest.raises(ValueError, match="shape"):
        await dense.apply_weights({**tensors, name: tensors[name][:-1]}, before + 1)
    with pytest.raises(ValueError, match="keep names"):
        await dense.apply_weights(tensors, before + 1, keep={"model.nope"})
    with pytest.raises(RolloutInputError, match="vocabulary"):
        await dense.generate([5, 10**6], {})
    assert dense.policy_version == before


async def test_apply_weights_switches_model_and_version(dense, tiny_qwen3_b):
    result = await dense.apply_weights(load_tensors(tiny_qwen3_b), 1)
    assert result["version"] == 1 and result["previous_version"] == 0
    assert result["untouched"] == []
    assert dense.policy_version == 1
    await _assert_parity(dense, tiny_qwen3_b)
    # Once weights are loaded, the same version again is refused (a fresh pod takes version 0 once).
    with pytest.raises(ValueError, match="already serves"):
        await dense.apply_weights(load_tensors(tiny_qwen3_b), 1)
    # keep= lets a sender skip tensors on purpose; they keep their current (B) values.
    tensors = load_tensors(tiny_qwen3_b)
    kept = {"model.norm.weight"}
    result = await dense.apply_weights({k: v for k, v in tensors.items() if k not in kept}, 2, keep=kept)
    assert result["untouched"] == ["model.norm.weight"]
    await _assert_parity(dense, tiny_qwen3_b, n=1)


async def _wait_running(engine: RolloutEngine) -> None:
    """Until the request just submitted is registered and the engine has stepped a few times since."""
    for _ in range(2000):
        if engine._inflight:
            break
        await asyncio.sleep(0.002)
    steps = engine.stats.steps
    for _ in range(2000):
        if engine.stats.steps >= steps + 3:
            return
        await asyncio.sleep(0.002)
    raise AssertionError("request never started")


@pytest.mark.parametrize("mode", ["finish", "abort"])
async def test_request_racing_an_update_sees_exactly_one_version(dense, tiny_qwen3, tiny_qwen3_b, mode):
    """In flight during the update: finishes on (or is aborted at) the old version, never mixes weights."""
    dense.settings.rollout.inflight_on_update = mode
    try:
        await dense.apply_weights(load_tensors(tiny_qwen3_b), dense.policy_version + 1)
        old = dense.policy_version
        models = {old: tiny_qwen3_b, old + 1: tiny_qwen3}
        long = asyncio.ensure_future(dense.generate(PROMPT, {"max_tokens": 160, "ignore_eos": True, "seed": 3}))
        await _wait_running(dense)
        steps_before = dense.stats.steps
        update = asyncio.ensure_future(dense.apply_weights(load_tensors(tiny_qwen3), old + 1))
        await asyncio.sleep(0)  # the update has closed the gate: this request must start on the new version
        late = asyncio.ensure_future(dense.generate(PROMPT, {"max_tokens": 8, "seed": 4}))
        racing, applied, after = await asyncio.gather(long, update, late)
        assert dense.stats.steps > steps_before
        sample = racing.samples[0]
        assert racing.policy_version == sample.policy_version == old
        if mode == "finish":
            assert sample.finish_reason == "length" and len(sample.token_ids) == 160
            assert applied["waited_for"] == 1 and applied["aborted"] == 0
        else:
            assert sample.finish_reason == "abort" and len(sample.token_ids) < 160
            assert applied["aborted"] == 1
        assert sample.token_ids  # it ran for a few steps before the update
        if sample.token_ids:  # every token of the racing request came from the old weights
            assert max_abs_diff(sample.logprobs, hf_token_logprobs(models[old], PROMPT, sample.token_ids)) < TOL
        assert after.policy_version == old + 1 == dense.policy_version
        late_sample = after.samples[0]
        want = hf_token_logprobs(models[old + 1], PROMPT, late_sample.token_ids)
        assert max_abs_diff(late_sample.logprobs, want) < TOL
    finally:
        dense.settings.rollout.inflight_on_update = "finish"
