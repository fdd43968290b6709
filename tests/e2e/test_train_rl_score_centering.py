"""Molt's score centering end to end: `molt train-rl --actor.loss_mode reinforce --actor.score_centering
--rollout.top_logprobs K` on the tiny model. The gateway records the pods' top-k with every action token, the
trainer trains on them (prefix packing off) and reports the heads' masses, equal for the fp32 pod and trainer
when each row is at its token's step; every trajectory is trained, none refused for lacking its top-k."""

import json

import pytest

from tests.e2e.test_train_rl_tiny import MATH, _sums, _train_rl

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]


def test_reinforce_with_score_centering_trains_on_the_recorded_heads(tiny_qwen3, tmp_path):
    run = tmp_path / "run"
    flags = [
        *("--actor.model_name_or_path", str(tiny_qwen3), "--train.agent_path", str(MATH)),
        *("--data.prompt_dataset", str(_sums(tmp_path / "data", 4)), "--data.input_key", "prompt"),
        *("--data.label_key", "reward_model", "--data.apply_chat_template", "--data.max_len", "128"),
        *("--rollout.batch_size", "2", "--rollout.n_samples_per_prompt", "2", "--rollout.max_new_tokens", "8"),
        *("--rollout.temperature", "1.0", "--rollout.top_p", "1.0", "--rollout.top_logprobs", "4"),
        *("--train.batch_size", "4", "--train.micro_batch_size", "2", "--vllm.num_engines", "1"),
        *("--vllm.enforce_eager", "--actor.loss_mode", "reinforce", "--actor.score_centering"),
        *("--algo.advantage.is_correction_level", "token", "--algo.advantage.is_correction_mode", "trunc"),
        *("--algo.advantage.is_correction_threshold", "0", "2", "--algo.kl.init_coef", "0"),
        *("--ckpt.save_steps", "-1", "--ckpt.disable_final_save"),
    ]
    _train_rl(run, flags)
    steps = [json.loads(x) for x in (run / "steps.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2]
    for s in steps:
        assert s["samples"] == 4, s  # nothing refused for a missing top-k
        q, p = s["score_centering_sampler_head_mass"], s["score_centering_policy_head_mass"]
        assert 0 < q <= 1 + 1e-4 and 0 < p <= 1 + 1e-4, s
        # The fp32 pod and trainer score the same tokens: equal masses mean each row sits at its token's step.
        assert abs(q - p) < 1e-3 * q, s
