"""Molt flags newer than release 0.1.6 that `molt train-rl` takes (its main branch's train_rl_ray.py): each
reaches the service that owns it, so a script written for a newer Molt runs here too."""

from __future__ import annotations

import pytest

from molt.config import parse_settings
from molt.stack import train_rl as tr
from molt.stack import train_rl_helm as trh
from services.gateway.config import GatewaySettings
from services.trainer.config import TrainerSettings

BASE = ["--actor.model_name_or_path", "/m", "--train.agent_path", "/a.py"]

# Names added after 0.1.6 that go to the trainer as they are.
TRAINER_FLAGS = {
    "reward.overlong_buffer_len": "256",
    "reward.overlong_penalty_factor": "1.0",
    "reward.stop_properly_penalty_coef": "0.5",
    "actor.loss_agg_mode": "prompt-mean-token-mean",
    "algo.advantage.is_correction_level": "token",
    "algo.advantage.is_correction_mode": "trunc",
    "algo.advantage.is_correction_gating": "binary_kl",
    "algo.advantage.is_correction_threshold": "0.005",
}


def test_newer_learning_flags_reach_the_trainer():
    argv = [a for name, value in TRAINER_FLAGS.items() for a in ("--" + name, value)]
    r = tr.route(BASE + argv, "helm")
    assert r.trainer[2:] == argv
    parse_settings(TrainerSettings, ["--actor.model_name_or_path", "/m", *argv], prog="trainer")


def test_molts_other_lora_spelling_is_the_trainers_lora_flags():
    r = tr.route(
        BASE + ["--actor.lora_dim", "16", "--actor.lora_alpha", "32", "--actor.lora_target_modules", "*.q_proj"],
        "helm",
    )
    assert r.trainer[2:] == [
        "--actor.lora.rank", "16", "--actor.lora.alpha", "32", "--actor.lora.target_modules", "*.q_proj",
    ]  # fmt: skip
    lora = parse_settings(TrainerSettings, ["--actor.model_name_or_path", "/m", *r.trainer[2:]], prog="t").actor.lora
    assert (lora.rank, lora.alpha, list(lora.target_modules)) == (16, 32, ["*.q_proj"])


def test_chat_template_kwargs_become_the_gateways_defaults():
    kwargs = '{"enable_thinking": false}'
    r = tr.route(BASE + ["--data.chat_template_kwargs", kwargs], "helm")
    assert r.gateway == ["--gateway.default_chat_template_kwargs", kwargs]
    assert "--data.chat_template_kwargs" not in r.trainer
    gw = parse_settings(GatewaySettings, r.gateway, prog="gateway")
    assert gw.gateway.default_chat_template_kwargs == {"enable_thinking": False}
    assert trh.helm_values(r)["gateway"]["extraArgs"] == r.gateway


def test_score_centering_takes_the_gateways_top_logprobs_and_is_refused_without():
    """Molt's --actor.score_centering (REINFORCE) needs the sampler's top-k in every trajectory, which the
    gateway records with --rollout.top_logprobs K; without it the run is refused before anything starts."""
    flags = ["--actor.loss_mode", "reinforce", "--actor.score_centering"]
    r = tr.route(BASE + flags + ["--rollout.top_logprobs", "8"], "helm")
    assert r.gateway == ["--rollout.top_logprobs", "8"] and r.trainer[2:] == flags
    assert parse_settings(GatewaySettings, r.gateway, prog="gateway").rollout.top_logprobs == 8
    assert parse_settings(
        TrainerSettings, ["--actor.model_name_or_path", "/m", *flags], prog="t"
    ).actor.score_centering
    for extra in ([], ["--rollout.top_logprobs", "0"]):
        with pytest.raises(ValueError, match="--actor.score_centering needs .* --rollout.top_logprobs K >= 1"):
            tr.route(BASE + flags + extra, "helm")


def test_a_head_wider_than_20_raises_the_pods_max_logprobs():
    """Molt raises vLLM's max_logprobs for a score-centering head above OpenAI's 20; here the pods get
    --vllm.max_logprobs K unless the script set it, and a bound below K is refused before anything starts."""
    flags = ["--actor.loss_mode", "reinforce", "--actor.score_centering", "--rollout.top_logprobs", "32"]
    r = tr.route(BASE + flags, "helm")
    assert r.gateway == ["--rollout.top_logprobs", "32"] and r.rollout[-2:] == ["--vllm.max_logprobs", "32"]
    assert parse_settings(GatewaySettings, r.gateway, prog="gateway").rollout.top_logprobs == 32
    assert "--vllm.max_logprobs" not in tr.route(BASE + ["--rollout.top_logprobs", "8"], "helm").rollout
    assert tr.route(BASE + flags + ["--vllm.max_logprobs", "64"], "helm").rollout == ["--vllm.max_logprobs", "64"]
    with pytest.raises(ValueError, match="--vllm.max_logprobs 16 is below --rollout.top_logprobs 32"):
        tr.route(BASE + flags + ["--vllm.max_logprobs", "16"], "helm")
