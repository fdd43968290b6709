"""Typed config blocks for the RL algorithm knobs, with Molt's flag names and defaults.

Services embed these sections in their settings (``algo: AlgoConfig``, ``reward: RewardConfig``; the
trainer's ``--actor.*`` section subclasses ``ActorLossConfig`` and adds its optimizer fields), so the
flags read exactly as in Molt: ``--algo.advantage.estimator grpo --algo.kl.target 0.01``.

Checks that involve one field live on the field (pydantic validators: ``parse_settings`` reports them
with the flag name). Checks across sections live in ``validate_algo``, which the trainer runs once at
start-up after parsing: it applies Molt's derived defaults in place (clip range, beta,
on-policy-distillation forcing) and its rejections, raising ``ValueError`` that
names the flags and says how to fix them, and returns the non-fatal hints for the caller to log.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from molt.algorithms.advantages import get_advantage_estimator
from molt.algorithms.is_correction import LEVEL_FLAG, check_is_correction
from molt.algorithms.kl import KLController
from molt.algorithms.loss import PolicyLoss, check_policy_loss
from molt.algorithms.score_centering import check_score_centering
from molt.config import Section

DEFAULT_EPS_CLIP = (0.2, 0.2)
DEFAULT_KL_COEF = 0.01
DISTILL_KL_COEF = 1.0


def _pair(value: list[float], flag: str) -> list[float]:
    if len(value) != 2:
        raise ValueError(f"{flag} takes two values LOW HIGH, got {value}")
    return value


class AdvantageConfig(Section):
    estimator: str = "reinforce"
    """Advantage estimator: reinforce, rloo, reinforce_baseline, grpo, dr_grpo, on_policy_distill, gae,
    flash_reinforce, or a name registered with molt.algorithms.register_advantage_estimator."""
    gamma: float = Field(1.0, ge=0.0, le=1.0)
    """Discount factor (reinforce, gae)."""
    lam: float = Field(1.0, ge=0.0, le=1.0)
    """GAE lambda."""
    no_whiten: bool = False
    """Skip whitening advantages over the batch (affects reinforce, reinforce_baseline, gae)."""
    no_std_norm: bool = False
    """Whiten by subtracting the batch mean only, without dividing by the std (the same estimators)."""
    is_correction_level: Literal["off", "token", "seq", "geo"] = "off"
    """Train/rollout mismatch IS correction: off, token, seq (product over tokens) or geo (geometric mean)."""
    is_correction_mode: Literal["mask", "clip", "trunc"] = "mask"
    """What to do outside the threshold band: mask (drop), clip (clamp to band) or trunc (cap at HIGH);
    seq/geo support only mask."""
    is_correction_gating: Literal["ratio", "binary_kl", "tv"] = "ratio"
    """What is compared to the band: the IS ratio itself, or the binary KL / total variation between the
    rollout and trainer probabilities of each sampled token (a trust region; mask mode, upper bound only)."""
    is_correction_threshold: list[float] = [0.5, 5.0]
    """IS band LOW HIGH for the unit (ratio or divergence); one value is an upper bound only: 0 HIGH."""

    @field_validator("is_correction_threshold")
    @classmethod
    def _threshold(cls, v: list[float]) -> list[float]:
        if len(v) == 1:
            v = [0.0, v[0]]
        if len(v) != 2:
            raise ValueError(f"--algo.advantage.is_correction_threshold takes LOW HIGH, or HIGH alone, got {v}")
        if not 0 <= v[0] <= v[1] or v[1] <= 0:
            raise ValueError(f"needs 0 <= LOW <= HIGH and HIGH > 0, got {v}")
        return v


class KLConfig(Section):
    use_loss: bool = False
    """Put the KL to the reference in the loss (beta * kl_loss) instead of the reward."""
    estimator: Literal["k1", "k2", "k3"] = "k1"
    """KL estimator: k1 (log-ratio; recommended as reward), k2 or k3 (recommended in the loss)."""
    init_coef: float | None = Field(None, ge=0.0)
    """Initial KL coefficient beta. Unset: 0.01 (1.0 for on_policy_distill). 0 skips the reference model."""
    target: float | None = Field(None, ge=0.0)
    """Target KL of the adaptive controller. Unset or 0: beta stays fixed (Molt tests the flag for truth)."""
    horizon: int = Field(10_000, gt=0)
    """Adaptive controller horizon, in rollouts (a rollout's segments count once)."""


class AlgoConfig(Section):
    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig)
    kl: KLConfig = Field(default_factory=KLConfig)
    dynamic_filtering_enable: bool = False
    """Drop prompt groups whose mean score is outside the open range (DAPO dynamic sampling); needs n > 1."""
    dynamic_filtering_range: list[float] = [0.0, 1.0]
    """Open interval LOW HIGH the group mean score must fall in to be kept."""

    @field_validator("dynamic_filtering_range")
    @classmethod
    def _range(cls, v: list[float]) -> list[float]:
        _pair(v, "--algo.dynamic_filtering_range")
        if not v[0] < v[1]:
            raise ValueError(f"needs LOW < HIGH, got {v}")
        return v

    def resolved_kl_coef(self) -> float:
        """beta at step 0: ``--algo.kl.init_coef`` or its estimator-dependent default."""
        if self.kl.init_coef is not None:
            return self.kl.init_coef
        return DISTILL_KL_COEF if self.advantage.estimator == "on_policy_distill" else DEFAULT_KL_COEF


class ActorLossConfig(Section):
    loss_mode: str = "ppo"
    """Policy loss: ppo, gspo, cispo, reinforce, or a name registered with molt.algorithms.register_policy_loss."""
    eps_clip_low_high: list[float] | None = None
    """Ratio clip LOW HIGH: [1-LOW, 1+HIGH] for ppo/gspo; for cispo HIGH is an absolute ceiling >= 1.
    Unset: 0.2 0.2."""
    dual_clip: float | None = None
    """PPO dual clip c > 1 (bounds the loss of tokens with negative advantage). Unset: off."""
    entropy_coef: float | None = None
    """Entropy bonus coefficient (subtracted times the token-mean entropy). Unset/0: entropy not computed."""
    loss_agg_mode: Literal["token-mean", "seq-mean-token-mean", "prompt-mean-token-mean"] = "token-mean"
    """How the actor's per-token losses are averaged over a step: every token weighs the same (token-mean),
    every trajectory segment (seq-mean-token-mean: token mean per segment, then mean) or every prompt group
    (prompt-mean-token-mean)."""
    score_centering: bool = False
    """REINFORCE only: centre each sampled token's score on the sampler's distribution, using the top-k
    log-probs the gateway records (--rollout.top_logprobs K); IS correction off or token level with the ratio."""

    def resolved_eps_clip(self) -> tuple[float, float]:
        eps = self.eps_clip_low_high
        return (float(eps[0]), float(eps[1])) if eps else DEFAULT_EPS_CLIP


class CriticLossConfig(Section):
    value_clip: float | None = Field(0.2, gt=0.0)
    """Critic value clip around the rollout-time value. Unset: unclipped squared error."""


class RewardConfig(Section):
    clip_range: list[float] = [-10.0, 10.0]
    """Rewards are clamped to LOW HIGH before the advantage estimator (after the length penalties)."""
    overlong_buffer_len: float | None = None
    """Overlong penalty: a rollout whose longest segment reaches into the last L tokens of --data.max_len loses
    factor * (tokens past max_len - L) / L. Unset: off."""
    overlong_penalty_factor: float = 1.0
    """The overlong penalty at a full context."""
    stop_properly_penalty_coef: float | None = None
    """Truncated rollouts: in [0, 1] scales their reward, below 0 replaces it. Unset: off."""

    @field_validator("clip_range")
    @classmethod
    def _clip(cls, v: list[float]) -> list[float]:
        _pair(v, "--reward.clip_range")
        if not v[0] <= v[1]:
            raise ValueError(f"needs LOW <= HIGH, got {v}")
        return v


def validate_algo(
    algo: AlgoConfig,
    actor: ActorLossConfig,
    rollout_n_samples: int,
    async_queue_size: int = 1,
    partial_rollout: bool = False,
    top_p: float = 1.0,
    *,
    eval_only: bool = False,
) -> list[str]:
    """Apply Molt's derived defaults in place and its cross-flag rejections; return hints to log."""
    hints: list[str] = []
    adv, kl = algo.advantage, algo.kl
    if actor.eps_clip_low_high is None:
        actor.eps_clip_low_high = list(DEFAULT_EPS_CLIP)
    estimator = get_advantage_estimator(adv.estimator)
    if adv.estimator == "on_policy_distill":
        if kl.use_loss or kl.estimator != "k1":
            hints.append(
                "on_policy_distill uses the teacher KL as its reward: forcing --algo.kl.estimator k1, "
                "--algo.kl.use_loss off"
            )
        kl.estimator, kl.use_loss = "k1", False
    if kl.init_coef is None:
        kl.init_coef = algo.resolved_kl_coef()
    if adv.no_whiten and adv.no_std_norm:
        raise ValueError(
            "--algo.advantage.no_whiten skips whitening altogether, --algo.advantage.no_std_norm keeps its mean "
            "subtraction: pass one of them"
        )
    if adv.no_std_norm and not estimator.whitens:
        hints.append(f"--algo.advantage.no_std_norm has no effect: {adv.estimator} advantages are not whitened")
    if estimator.grouped and rollout_n_samples <= 1 and not eval_only:
        raise ValueError(
            f"--algo.advantage.estimator {adv.estimator} compares rollouts of the same prompt and needs "
            f"--rollout.n_samples_per_prompt > 1 (got {rollout_n_samples}); raise it (e.g. 8) or use reinforce"
        )
    if kl.init_coef > 0:
        if kl.use_loss and kl.estimator == "k1":
            hints.append("KL in the loss: --algo.kl.estimator k3 (or k2) is recommended over k1")
        if not kl.use_loss and kl.estimator != "k1":
            hints.append("KL as reward: --algo.kl.estimator k1 is recommended")
        if not kl.use_loss and estimator.grouped:
            hints.append(
                f"{adv.estimator} ignores the KL reward (it only shows in metrics): set --algo.kl.use_loss to "
                "regularise towards the reference, or --algo.kl.init_coef 0 to skip the reference model"
            )
    if algo.dynamic_filtering_enable and rollout_n_samples <= 1:
        raise ValueError(
            "--algo.dynamic_filtering_enable needs --rollout.n_samples_per_prompt > 1 "
            f"(got {rollout_n_samples}): a single rollout per prompt has no group to filter"
        )
    is_on = adv.is_correction_level != "off"
    if not is_on and (async_queue_size > 1 or partial_rollout):
        cause = "--train.partial_rollout_enable"
        if async_queue_size > 1:
            cause = f"--train.async_queue_size {async_queue_size}"
        raise ValueError(
            f"{cause} trains on rollouts from older weights, which needs importance-sampling correction: set "
            f"{LEVEL_FLAG} token|seq|geo (e.g. geo with --algo.advantage.is_correction_threshold 0.99 1.01), "
            "or train synchronously (--train.async_queue_size 1, no partial rollouts)"
        )
    if not is_on:
        hints.append(f"{LEVEL_FLAG} off: the vLLM/trainer log-prob mismatch is not corrected")
    if is_on and partial_rollout:
        hints.append("--train.partial_rollout_enable: one sequence can mix tokens of several policy versions")
    if is_on and top_p < 1.0:
        raise ValueError(
            f"{LEVEL_FLAG} {adv.is_correction_level} needs --rollout.top_p 1.0 (got {top_p}): vLLM's processed "
            f"log-probs are renormalised over the nucleus and no longer match the trainer's; "
            f"set --rollout.top_p 1.0 or {LEVEL_FLAG} off"
        )
    check_is_correction(
        adv.is_correction_level, adv.is_correction_mode, adv.is_correction_threshold, adv.is_correction_gating
    )
    check_policy_loss(actor.loss_mode, actor.resolved_eps_clip(), actor.dual_clip)
    if actor.score_centering:
        check_score_centering(actor.loss_mode, adv.is_correction_level, adv.is_correction_gating)
    if actor.loss_mode == "reinforce" and actor.eps_clip_low_high is not None:
        hints.append("--actor.eps_clip_low_high has no effect with --actor.loss_mode reinforce (nothing is clipped)")
    return hints


def build_policy_loss(actor: ActorLossConfig, algo: AlgoConfig) -> PolicyLoss:
    """The trainer's ``PolicyLoss`` from the (validated) config."""
    return PolicyLoss(
        actor.loss_mode,
        eps_clip=actor.resolved_eps_clip(),
        dual_clip=actor.dual_clip,
        is_level=algo.advantage.is_correction_level,
        is_mode=algo.advantage.is_correction_mode,
        is_threshold=algo.advantage.is_correction_threshold,
        is_gating=algo.advantage.is_correction_gating,
        score_centering=actor.score_centering,
    )


def build_kl_controller(algo: AlgoConfig) -> KLController:
    return KLController(algo.resolved_kl_coef(), target=algo.kl.target or None, horizon=algo.kl.horizon)


__all__ = [
    "ActorLossConfig",
    "AdvantageConfig",
    "AlgoConfig",
    "CriticLossConfig",
    "KLConfig",
    "RewardConfig",
    "build_kl_controller",
    "build_policy_loss",
    "validate_algo",
]
