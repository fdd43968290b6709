"""Pure RL algorithms: advantages, KL, policy / value losses, IS correction, dynamic filtering.

Everything here is a torch function on step-axis tensors (``[B, T]``, step k predicts token k+1,
``action_mask`` True on policy-generated tokens). Nothing knows about services, transports or
models, so the trainer service, the rollout side and the unit tests call the same code. Formulas,
defaults and flag names follow Molt (docs/algorithms.md); each module's docstring
states its part.

Stable entry points (the trainer service codes against these signatures)::

    # start-up
    hints = validate_algo(algo, actor, rollout_n_samples, async_queue_size, partial_rollout, top_p)
    policy_loss = build_policy_loss(actor, algo)        # PolicyLoss(loss_mode, eps_clip=, dual_clip=, is_*=)
    kl_ctl = build_kl_controller(algo)                  # KLController(init_coef, target=, horizon=)

    # make experience (no grad)
    kl = approx_kl(old_logp, ref_logp, algo.kl.estimator)           # [B, T]; k1 | k2 | k3
    advantages, returns = compute_advantages(
        algo.advantage.estimator, rewards, action_mask, group_ids=..., rollout_ids=..., kl=kl, values=values,
        gamma=..., lam=..., kl_coef=kl_ctl.value, whiten=not algo.advantage.no_whiten,
        std_norm=not algo.advantage.no_std_norm, reward_clip=tuple(reward.clip_range))

    # every micro-batch of an optimizer-step window with N action tokens over all micro-batches and ranks
    out = policy_loss(logp, old_logp, advantages, mask, num_window_tokens=N, dp_size=dp, rollout_logp=rlp)
    # (--actor.score_centering: also head=SamplerHead(head_logp, sampler_head_logp, head_mask, old_head_logp),
    #  [B, T, K] each: the policy's log-probs of the sampler's recorded top-k ids, from the same forward)
    total = out.loss                                                  # global token-mean share
    # (--actor.loss_agg_mode seq-/prompt-mean-token-mean: pass row_scale=row_scales(mode, n_actions, groups)
    #  per window, and aggregate the other terms with scaled_sum)
    total = total + kl_ctl.value * token_mean(approx_kl(logp, ref_logp, "k3"), mask, num_window_tokens=N,
                                              dp_size=dp)            # --algo.kl.use_loss
    total = total - entropy_coef * token_mean(entropy, mask, num_window_tokens=N, dp_size=dp)
    total.backward(); metrics = out.metrics                          # detached 0-dim tensors
    critic = value_loss(v, v_old, returns, mask, value_clip=0.2, num_window_tokens=N, dp_size=dp)

    # after the step
    kl_ctl.update(step_kl, num_samples=rollout_batch_size * n_samples_per_prompt)

    # rollout side, per finished group (--algo.dynamic_filtering_enable)
    verdict = filter_group(rollout_ids, scores, n_samples_per_prompt=n, score_range=algo.dynamic_filtering_range)

Extending without touching the trainer: decorate a function with ``register_advantage_estimator(name,
grouped=..., whitens=...)`` (it receives an ``AdvantageBatch`` and returns ``(advantages, returns)``)
or ``register_policy_loss(name, supports_dual_clip=..., check_eps=...)`` (it receives
``SurrogateInputs`` and returns ``(per-token loss, clipped mask)``), import the module before the
trainer parses its flags, and select it with ``--algo.advantage.estimator name`` /
``--actor.loss_mode name``. Whitening, reward clipping, rollout de-duplication, IS correction, the
global token-mean and metrics are applied around it by the framework.
"""

from molt.algorithms import estimators as _builtin_estimators  # noqa: F401  (importing it registers them)
from molt.algorithms.advantages import (
    AdvantageBatch,
    AdvantageEstimator,
    advantage_estimator_names,
    compute_advantages,
    get_advantage_estimator,
    group_mean,
    group_size,
    group_std,
    register_advantage_estimator,
    whiten_advantages,
)
from molt.algorithms.aggregation import LOSS_AGG_MODES, row_scales
from molt.algorithms.config import (
    ActorLossConfig,
    AdvantageConfig,
    AlgoConfig,
    CriticLossConfig,
    KLConfig,
    RewardConfig,
    build_kl_controller,
    build_policy_loss,
    validate_algo,
)
from molt.algorithms.filtering import GroupVerdict, filter_group, filtering_metrics
from molt.algorithms.is_correction import IS_LEVELS, IS_MODES, ISCorrection, check_is_correction, is_correction
from molt.algorithms.kl import KL_ESTIMATORS, KLController, approx_kl
from molt.algorithms.loss import (
    PolicyLoss,
    PolicyLossOutput,
    SurrogateInputs,
    check_policy_loss,
    get_policy_loss,
    policy_loss_names,
    register_policy_loss,
)
from molt.algorithms.score_centering import SamplerHead, check_score_centering, head_correction
from molt.algorithms.tensor_ops import entropy_from_logits, masked_mean, sanitize_log_ratio, scaled_sum, token_mean
from molt.algorithms.value_loss import ValueLossOutput, value_loss

__all__ = [
    "IS_LEVELS",
    "IS_MODES",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "ActorLossConfig",
    "AdvantageBatch",
    "AdvantageConfig",
    "AdvantageEstimator",
    "AlgoConfig",
    "CriticLossConfig",
    "GroupVerdict",
    "ISCorrection",
    "KLConfig",
    "KLController",
    "PolicyLoss",
    "PolicyLossOutput",
    "RewardConfig",
    "SamplerHead",
    "SurrogateInputs",
    "ValueLossOutput",
    "advantage_estimator_names",
    "approx_kl",
    "build_kl_controller",
    "build_policy_loss",
    "check_is_correction",
    "check_policy_loss",
    "check_score_centering",
    "compute_advantages",
    "entropy_from_logits",
    "filter_group",
    "filtering_metrics",
    "get_advantage_estimator",
    "get_policy_loss",
    "group_mean",
    "group_size",
    "group_std",
    "head_correction",
    "is_correction",
    "masked_mean",
    "policy_loss_names",
    "register_advantage_estimator",
    "register_policy_loss",
    "row_scales",
    "sanitize_log_ratio",
    "scaled_sum",
    "token_mean",
    "validate_algo",
    "value_loss",
    "whiten_advantages",
]
