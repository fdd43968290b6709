"""Shared-prefix packing gives the plain layout's numbers on real models: per-token log-probs and entropy
of a real transformers forward, and a whole FSDP2 learner step (metrics and updated weights)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from molt.schema import Segment, Trajectory
from services.trainer.batch import collate, samples_from_trajectory
from services.trainer.learner import Learner, token_logprobs
from services.trainer.model import full_state_dict, init_distributed
from services.trainer.packing import pack, packed_token_logprobs
from tests.integration.test_trainer_algos import _settings


def _group_trajectories(num_groups=3, n=4, prompt_len=12, seed=0):
    """GRPO-shaped: n samples per prompt, completions of different lengths, one with a second turn."""
    rng = np.random.default_rng(seed)
    out = []
    for g in range(num_groups):
        prompt = rng.integers(3, 1000, prompt_len)
        for j in range(n):
            done = rng.integers(3, 1000, 3 + 2 * j)
            tokens = np.concatenate([prompt, done])
            spans = [[prompt_len, len(tokens)]]
            if j == 1:  # a tool turn and a second action span
                tokens = np.concatenate([tokens, rng.integers(3, 1000, 4), rng.integers(3, 1000, 5)])
                spans.append([len(tokens) - 5, len(tokens)])
            n_act = sum(b - a for a, b in spans)
            out.append(
                Trajectory(
                    f"t{g}-{j}",
                    f"g{g}",
                    j,
                    [Segment(tokens, spans, -rng.uniform(0.1, 3, n_act), np.zeros(n_act, int))],
                    float(j % 2),
                )
            )
    return out


@pytest.mark.parametrize("model_fixture", ["tiny_qwen3", "tiny_llama_untied"])
def test_packed_logprobs_equal_the_plain_forward(model_fixture, request):
    model = AutoModelForCausalLM.from_pretrained(
        request.getfixturevalue(model_fixture), dtype=torch.float32, attn_implementation="sdpa"
    )
    samples = [s for t in _group_trajectories() for s in samples_from_trajectory(t, 100)]
    mb = collate(samples)
    plain, plain_ent = token_logprobs(
        model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits, mb.input_ids, 0.8
    )
    rows = pack(samples, 2048)
    assert rows.num_tokens < mb.input_ids.numel()  # the prefixes were shared
    logp, ent = packed_token_logprobs(model, rows, len(samples), mb.action_mask.shape[1], 0.8)
    mask = mb.action_mask
    assert torch.allclose(logp, plain * mask, atol=1e-5)
    assert torch.allclose(ent * mask, plain_ent * mask, atol=1e-5)
    assert not logp[~mask].any()


@pytest.fixture(scope="module")
def world():
    info = init_distributed()
    yield info
    dist.destroy_process_group()


def test_a_learner_step_is_the_same_packed_or_plain(world, tiny_qwen3):
    flags = [
        "--algo.advantage.estimator",
        "grpo",
        "--algo.kl.init_coef",
        "0",
        "--rollout.n_samples_per_prompt",
        "4",
        "--train.batch_size",
        "12",
        "--train.micro_batch_size",
        "4",
        "--train.force_on_policy",
    ]
    results = []
    for packed in ("true", "false"):
        torch.manual_seed(0)
        learner = Learner(_settings(tiny_qwen3, *flags, "--train.pack_shared_prefix", packed), world)
        assert learner.packing == (packed == "true")
        samples = [s for t in _group_trajectories() for s in samples_from_trajectory(t, 100)]
        stats = learner.train_step(samples)
        results.append((stats, full_state_dict(learner.actor)))
    (a, wa), (b, wb) = results
    for key in ("policy_loss", "actor_grad_norm", "entropy", "vllm_kl_all_pods"):
        assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
    # Adam divides by sqrt(v): on near-zero gradients float noise moves an element by a fraction of the lr (1e-3).
    assert max(float((wa[k] - wb[k]).abs().max()) for k in wa) < 1e-4
