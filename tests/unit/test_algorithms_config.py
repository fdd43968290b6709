"""Algorithm config blocks (Molt names and defaults) and validate_algo."""

from __future__ import annotations

import pytest
from pydantic import Field, ValidationError

from molt.algorithms import (
    ActorLossConfig,
    AlgoConfig,
    CriticLossConfig,
    KLController,
    PolicyLoss,
    RewardConfig,
    build_kl_controller,
    build_policy_loss,
    validate_algo,
)
from molt.config import Section, build_parser, parse_settings


class _Settings(Section):
    """A trainer-like settings tree embedding the algorithm blocks."""

    algo: AlgoConfig = Field(default_factory=AlgoConfig)
    actor: ActorLossConfig = Field(default_factory=ActorLossConfig)
    critic: CriticLossConfig = Field(default_factory=CriticLossConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)


def _validate(algo=None, actor=None, n=8, **kw):
    algo, actor = algo or AlgoConfig(), actor or ActorLossConfig()
    return validate_algo(algo, actor, n, **kw), algo, actor


def test_molt_defaults():
    s = _Settings()
    assert (s.algo.advantage.estimator, s.algo.advantage.gamma, s.algo.advantage.lam) == ("reinforce", 1.0, 1.0)
    assert not s.algo.advantage.no_whiten
    assert (s.algo.advantage.is_correction_level, s.algo.advantage.is_correction_mode) == ("off", "mask")
    assert s.algo.advantage.is_correction_threshold == [0.5, 5.0]
    assert (s.algo.kl.use_loss, s.algo.kl.estimator, s.algo.kl.init_coef) == (False, "k1", None)
    assert (s.algo.kl.target, s.algo.kl.horizon) == (None, 10_000)
    assert not s.algo.dynamic_filtering_enable and s.algo.dynamic_filtering_range == [0.0, 1.0]
    assert (s.actor.loss_mode, s.actor.eps_clip_low_high, s.actor.dual_clip, s.actor.entropy_coef) == (
        "ppo",
        None,
        None,
        None,
    )
    assert s.critic.value_clip == 0.2 and s.reward.clip_range == [-10.0, 10.0]


def test_dotted_flags_and_help_text():
    argv = [
        "--algo.advantage.estimator",
        "grpo",
        "--algo.advantage.is_correction_level",
        "geo",
        "--algo.advantage.is_correction_threshold",
        "0.99",
        "1.01",
        "--algo.kl.target",
        "0.01",
        "--actor.eps_clip_low_high",
        "0.2",
        "0.27",
        "--actor.dual_clip",
        "10",
        "--algo.advantage.no_whiten",
        "--reward.clip_range",
        "-1",
        "1",
    ]
    s = parse_settings(_Settings, argv, environ={})
    assert s.algo.advantage.estimator == "grpo" and s.algo.advantage.is_correction_threshold == [0.99, 1.01]
    assert s.actor.eps_clip_low_high == [0.2, 0.27] and s.actor.dual_clip == 10.0
    assert s.algo.advantage.no_whiten and s.reward.clip_range == [-1.0, 1.0] and s.algo.kl.target == 0.01
    # Molt tests the flag for truth: a target of 0 keeps beta fixed, as leaving it unset does
    fixed = parse_settings(_Settings, ["--algo.kl.target", "0"], environ={})
    assert not build_kl_controller(fixed.algo).adaptive
    help_text = build_parser(_Settings, "trainer").format_help()
    assert "--algo.advantage.lam" in help_text and "GAE lambda" in help_text
    with pytest.raises(SystemExit):  # choices are enforced by the parser
        parse_settings(_Settings, ["--algo.advantage.is_correction_mode", "cap"], environ={})


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: AlgoConfig(advantage={"is_correction_threshold": [0.5, 1, 2]}), "takes LOW HIGH, or HIGH alone"),
        (lambda: AlgoConfig(advantage={"is_correction_threshold": [2.0, 1.0]}), "LOW <= HIGH"),
        (lambda: AlgoConfig(dynamic_filtering_range=[1.0, 0.0]), "LOW < HIGH"),
        (lambda: AlgoConfig(kl={"target": -0.01}), "greater than or equal to 0"),
        (lambda: AlgoConfig(advantage={"gamma": 1.5}), "less than or equal to 1"),
        (lambda: RewardConfig(clip_range=[1.0, -1.0]), "LOW <= HIGH"),
    ],
)
def test_field_checks(make, match):
    with pytest.raises(ValidationError, match=match):
        make()


def test_derived_defaults():
    hints, algo, actor = _validate()
    assert actor.eps_clip_low_high == [0.2, 0.2] and algo.kl.init_coef == 0.01
    assert any("is_correction_level off" in h for h in hints)
    distill = AlgoConfig(advantage={"estimator": "on_policy_distill"}, kl={"use_loss": True, "estimator": "k3"})
    hints, algo, _ = _validate(distill, n=1)
    assert any("forcing --algo.kl.estimator k1" in h for h in hints)
    assert (algo.kl.estimator, algo.kl.use_loss, algo.kl.init_coef) == ("k1", False, 1.0)
    kept = AlgoConfig(advantage={"estimator": "on_policy_distill"}, kl={"init_coef": 0.5})
    assert _validate(kept)[1].kl.init_coef == 0.5


def test_kl_hints():
    hints, *_ = _validate(AlgoConfig(kl={"use_loss": True}))
    assert any("k3 (or k2) is recommended" in h for h in hints)
    hints, *_ = _validate(AlgoConfig(advantage={"estimator": "grpo"}))
    assert any("grpo ignores the KL reward" in h for h in hints)
    hints, *_ = _validate(AlgoConfig(kl={"init_coef": 0.0, "estimator": "k3"}))
    assert not any("KL" in h for h in hints)


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo", "reinforce_baseline"])
def test_group_estimators_need_several_samples(estimator):
    algo = AlgoConfig(advantage={"estimator": estimator})
    needs_n = f"--algo.advantage.estimator {estimator} .* --rollout.n_samples_per_prompt > 1"
    with pytest.raises(ValueError, match=needs_n):
        _validate(algo, n=1)
    _validate(AlgoConfig(advantage={"estimator": estimator}), n=1, eval_only=True)
    _validate(AlgoConfig(advantage={"estimator": estimator}), n=2)


@pytest.mark.parametrize(
    ("algo", "actor", "kw", "match"),
    [
        ({}, {}, {"async_queue_size": 2}, "--train.async_queue_size 2 .* set --algo.advantage.is_correction_level"),
        ({}, {}, {"partial_rollout": True}, "--train.partial_rollout_enable .*is_correction_level token"),
        ({"advantage": {"is_correction_level": "token"}}, {}, {"top_p": 0.9}, "needs --rollout.top_p 1.0"),
        ({"advantage": {"is_correction_level": "seq", "is_correction_mode": "clip"}}, {}, {}, "supports only"),
        ({"advantage": {"is_correction_level": "geo", "is_correction_mode": "trunc"}}, {}, {}, "supports only"),
        ({}, {"dual_clip": 1.0}, {}, "--actor.dual_clip must be > 1"),
        ({}, {"loss_mode": "gspo", "dual_clip": 10.0}, {}, "--actor.dual_clip works only with --actor.loss_mode ppo"),
        ({}, {"loss_mode": "cispo"}, {}, "--actor.eps_clip_low_high 0.2 5.0"),
        ({}, {"loss_mode": "dpo"}, {}, "unknown policy loss 'dpo'"),
        ({"advantage": {"estimator": "ppo"}}, {}, {}, "unknown advantage estimator 'ppo'"),
        ({"dynamic_filtering_enable": True}, {}, {"n": 1}, "--algo.dynamic_filtering_enable needs"),
    ],
)
def test_rejections_name_the_flags(algo, actor, kw, match):
    with pytest.raises(ValueError, match=match):
        _validate(AlgoConfig(**algo), ActorLossConfig(**actor), **kw)


def test_accepted_async_recipe_and_builders():
    algo = AlgoConfig(
        advantage={"estimator": "grpo", "is_correction_level": "geo", "is_correction_threshold": [0.99, 1.01]},
        kl={"target": 0.02, "horizon": 500},
    )
    actor = ActorLossConfig(eps_clip_low_high=[0.2, 0.27], dual_clip=10.0)
    hints, *_ = _validate(algo, actor, async_queue_size=2, partial_rollout=True)
    assert any("--train.partial_rollout_enable" in h for h in hints)
    loss = build_policy_loss(actor, algo)
    assert isinstance(loss, PolicyLoss) and (loss.eps_low, loss.eps_high, loss.dual_clip) == (0.2, 0.27, 10.0)
    assert (loss.is_level, loss.is_mode, loss.is_threshold) == ("geo", "mask", (0.99, 1.01))
    ctl = build_kl_controller(algo)
    assert isinstance(ctl, KLController) and ctl.adaptive and (ctl.value, ctl.horizon) == (0.01, 500)
    cispo = ActorLossConfig(loss_mode="cispo", eps_clip_low_high=[0.2, 5.0])
    _validate(actor=cispo)


def test_no_std_norm_is_refused_beside_no_whiten_and_hinted_where_nothing_is_whitened():
    with pytest.raises(ValueError, match="no_whiten skips whitening altogether.*no_std_norm"):
        _validate(AlgoConfig.model_validate({"advantage": {"no_whiten": True, "no_std_norm": True}}))
    hints, _, _ = _validate(AlgoConfig.model_validate({"advantage": {"estimator": "grpo", "no_std_norm": True}}))
    assert any("no_std_norm has no effect: grpo" in h for h in hints)
    hints, _, _ = _validate(AlgoConfig.model_validate({"advantage": {"no_std_norm": True}}))
    assert not any("no_std_norm" in h for h in hints)
