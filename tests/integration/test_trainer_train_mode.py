"""Training passes run in train mode and no-grad passes in eval mode, as Molt's do. HF applies activation
checkpointing (and dropout) only in train mode, so a policy left in from_pretrained's eval mode silently ignored
``--actor.gradient_checkpoint`` and SFT's default ``--model.gradient_checkpoint full``."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from molt.config import parse_settings
from services.trainer.learner import Learner
from services.trainer.model import decoder_layers, eval_mode, init_distributed, load_causal_lm
from services.trainer.sft import SftLearner
from services.trainer.sft_config import SftSettings
from tests.integration.test_trainer_algos import _samples, _settings


@pytest.fixture(scope="module")
def world():
    info = init_distributed()
    yield info
    dist.destroy_process_group()


def _record(model: torch.nn.Module) -> list[tuple[bool, bool]]:
    """(train mode, grad enabled) of every call of the first decoder layer; a checkpointed layer runs twice per
    training pass (forward, then the recompute in backward)."""
    calls: list[tuple[bool, bool]] = []
    decoder_layers(model)[0].register_forward_pre_hook(
        lambda m, _args: calls.append((m.training, torch.is_grad_enabled()))
    )
    return calls


def _rl_step(model, world, checkpointing: str) -> tuple[list, list]:
    flags = ["--algo.advantage.estimator", "gae", "--algo.kl.init_coef", "0"]
    s = _settings(model, *flags, "--actor.gradient_checkpoint", checkpointing)  # the last spelling wins
    learner = Learner(s, world)
    assert learner.actor.training and learner.critic is not None and learner.critic.training
    actor, critic = _record(learner.actor), _record(learner.critic)
    learner.train_step(_samples())
    assert learner.actor.training and learner.critic.training  # the experience passes restored the mode
    return actor, critic


def test_rl_trains_in_train_mode_and_records_log_probs_in_eval_mode(world, tiny_qwen3):
    actor_off, critic_off = _rl_step(tiny_qwen3, world, "off")
    actor_full, critic_full = _rl_step(tiny_qwen3, world, "full")
    for calls in (actor_off, critic_off, actor_full, critic_full):
        assert any(not grad for _, grad in calls) and any(grad for _, grad in calls)
        # no-grad passes (old log-probs, values) in eval mode, passes that train in train mode
        assert all(training == grad for training, grad in calls), calls
    training_passes = sum(grad for _, grad in actor_off)
    assert sum(grad for _, grad in actor_full) == 2 * training_passes  # full checkpointing recomputes each layer
    assert sum(grad for _, grad in critic_full) == 2 * sum(grad for _, grad in critic_off)  # as Molt's critic


def test_sft_policy_starts_in_train_mode_and_checkpoints(world, tiny_qwen3):
    s = parse_settings(SftSettings, ["--model.model_name_or_path", str(tiny_qwen3), "--fsdp.strategy", "torch"])
    learner = SftLearner(s, world, total_steps=4)
    assert s.model.gradient_checkpoint == "full" and learner.actor.training
    calls = _record(learner.actor)
    ids = torch.randint(3, 500, (2, 12))
    learner.actor(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    assert calls == [(True, True), (True, True)]  # the forward and its recompute
    with eval_mode(learner.actor):
        assert not learner.actor.training
    assert learner.actor.training


def test_a_frozen_model_stays_in_eval_mode(world, tiny_qwen3):
    ref = load_causal_lm(str(tiny_qwen3), _fsdp_torch(), world, trainable=False)
    assert not ref.training and not any(p.requires_grad for p in ref.parameters())
    with eval_mode(ref, None):
        pass
    assert not ref.training


def _fsdp_torch():
    s = parse_settings(SftSettings, ["--model.model_name_or_path", "x", "--fsdp.strategy", "torch"])
    return s.fsdp
