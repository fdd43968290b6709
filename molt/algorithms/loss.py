"""Policy losses behind a name registry, with IS correction and the global token-mean.

One ``PolicyLoss`` is built per run from the actor/algo config (invalid combinations fail there, at
start-up) and called once per micro-batch on step-axis tensors:

1. lr = log pi_theta - log pi_old (NaN -> 0, +-inf -> +-30), advantages NaN/inf -> 0, both zeroed off
   the mask; ``old_logp=None`` (force-on-policy) means pi_old = the detached current forward (ratio 1,
   plain REINFORCE gradient);
2. the registered surrogate for ``--actor.loss_mode`` gives a per-token loss and a "clipped" mask:
   - ``ppo``: -min(rA, clamp(r, 1-eps_low, 1+eps_high)A); dual clip c (> 1): for A < 0,
     -max(min(...), cA). Clipped = the clamped term is strictly smaller;
   - ``gspo``: the sequence ratio e^S (S = masked mean lr, detached) carried by a per-token
     straight-through ratio exp(logp - sg(logp) + S), then PPO clipping without dual clip;
   - ``cispo``: -sg(min(r, eps_high)) * A * logp with ``eps_high`` an absolute ceiling >= 1;
   - ``reinforce``: -A * logp (pi_old unused, nothing clipped);
3. the IS coefficient (``is_correction.py``) multiplies the per-token loss;
4. ``--actor.score_centering`` (``score_centering.py``, reinforce only): + A * the sampler-head correction,
   after the IS coefficient (which weighs the sampled token's term only);
5. ``loss`` = global token-mean share (``tensor_ops.token_mean``), or the rows weighted by ``row_scale``
   (``--actor.loss_agg_mode``, see ``aggregation``): backprop it as is.

Metrics are detached 0-dim tensors (reduce across ranks before ``.item()``): ``policy_loss`` (plain
masked mean of the per-token loss, not the gradient quantity), ``policy_clip_ratio``, ``policy_kl``
(masked mean of log pi_old - log pi_theta), ``vllm_kl`` and ``is_filter_ratio`` (IS on only),
``entropy_loss`` (when per-token entropy is passed in), ``score_centering_sampler_head_mass`` /
``score_centering_policy_head_mass`` (mean sum over the head of q / of p; score centering on).

A new surrogate is one decorated function; ``--actor.loss_mode my_loss`` then works::

    @register_policy_loss("my_loss")
    def my_loss(inp: SurrogateInputs) -> tuple[Tensor, Tensor]:
        ratio = inp.log_ratio.exp()
        return -ratio * inp.advantages, torch.zeros_like(inp.action_mask)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from molt.algorithms.is_correction import check_is_correction, is_correction
from molt.algorithms.score_centering import (
    SCORE_CENTERING_FLAG,
    HeadCorrection,
    SamplerHead,
    check_score_centering,
    head_correction,
)
from molt.algorithms.tensor_ops import (
    LOG_RATIO_LIMIT,
    as_bool_mask,
    at_least_fp32,
    masked_mean,
    sanitize_log_ratio,
    scaled_sum,
    token_mean,
)


@dataclass(frozen=True)
class SurrogateInputs:
    """What a surrogate sees; every tensor is [B, T] and zero off the mask."""

    logp: Tensor
    """log pi_theta of the sampled tokens (carries the gradient)."""
    log_ratio: Tensor
    """Sanitised log pi_theta - log pi_old."""
    advantages: Tensor
    action_mask: Tensor
    """bool."""
    eps_low: float
    eps_high: float
    dual_clip: float | None


SurrogateFn = Callable[[SurrogateInputs], tuple[Tensor, Tensor]]
"""Returns (per-token loss [B, T], clipped [B, T] bool)."""


@dataclass(frozen=True)
class PolicyLossSpec:
    name: str
    fn: SurrogateFn
    supports_dual_clip: bool
    check_eps: Callable[[float, float], None] | None
    """Raises ValueError for an ``--actor.eps_clip_low_high`` this loss cannot use."""


_LOSSES: dict[str, PolicyLossSpec] = {}


def register_policy_loss(
    name: str, *, supports_dual_clip: bool = False, check_eps: Callable[[float, float], None] | None = None
):
    """Decorator adding a surrogate under ``name``; re-registering a name is an error."""

    def deco(fn: SurrogateFn) -> SurrogateFn:
        if name in _LOSSES:
            raise ValueError(f"policy loss {name!r} is already registered")
        _LOSSES[name] = PolicyLossSpec(name, fn, supports_dual_clip, check_eps)
        return fn

    return deco


def get_policy_loss(name: str) -> PolicyLossSpec:
    if name not in _LOSSES:
        raise ValueError(
            f"unknown policy loss {name!r}; known: {', '.join(sorted(_LOSSES))} "
            "(--actor.loss_mode; register new ones with register_policy_loss)"
        )
    return _LOSSES[name]


def policy_loss_names() -> list[str]:
    return sorted(_LOSSES)


def check_policy_loss(loss_mode: str, eps_clip: Sequence[float], dual_clip: float | None) -> None:
    """Raise ``ValueError`` naming the ``--actor.*`` flags for an unusable loss configuration."""
    spec = get_policy_loss(loss_mode)
    if len(eps_clip) != 2 or min(eps_clip) < 0:
        raise ValueError(f"--actor.eps_clip_low_high takes two values LOW HIGH >= 0, got {list(eps_clip)}")
    if spec.check_eps is not None:
        spec.check_eps(float(eps_clip[0]), float(eps_clip[1]))
    if dual_clip is not None:
        if not spec.supports_dual_clip:
            raise ValueError(
                f"--actor.dual_clip works only with --actor.loss_mode ppo (got {loss_mode}); unset --actor.dual_clip"
            )
        if dual_clip <= 1:
            raise ValueError(f"--actor.dual_clip must be > 1 (e.g. 10), got {dual_clip}; or leave it unset")


def _check_ratio_eps(eps_low: float, eps_high: float) -> None:
    if eps_low >= 1:
        raise ValueError(f"--actor.eps_clip_low_high LOW must be < 1 (the ratio floor is 1 - LOW), got {eps_low}")


def _check_cispo_eps(eps_low: float, eps_high: float) -> None:
    if eps_high < 1:
        raise ValueError(
            f"--actor.loss_mode cispo reads HIGH of --actor.eps_clip_low_high as an absolute ratio ceiling, "
            f"which must be >= 1 (got {eps_high}); pass e.g. --actor.eps_clip_low_high 0.2 5.0"
        )


def masked_sum_rows(values: Tensor, action_mask: Tensor) -> Tensor:
    """[B, T] -> [B]: per-sequence sum over action tokens."""
    return torch.where(action_mask, values, torch.zeros_like(values)).sum(dim=1)


def _clipped_surrogate(ratio: Tensor, inp: SurrogateInputs) -> tuple[Tensor, Tensor]:
    unclipped = ratio * inp.advantages
    clipped = ratio.clamp(1 - inp.eps_low, 1 + inp.eps_high) * inp.advantages
    objective = torch.minimum(unclipped, clipped)
    return objective, clipped < unclipped


@register_policy_loss("ppo", supports_dual_clip=True, check_eps=_check_ratio_eps)
def ppo_loss(inp: SurrogateInputs) -> tuple[Tensor, Tensor]:
    ratio = torch.exp(inp.log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
    objective, was_clipped = _clipped_surrogate(ratio, inp)
    if inp.dual_clip is not None:
        # Bounds how much a single very-off-policy token with A < 0 can push (ratio >> 1).
        bounded = torch.maximum(objective, inp.dual_clip * inp.advantages)
        objective = torch.where(inp.advantages < 0, bounded, objective)
    return -objective, was_clipped & inp.action_mask


@register_policy_loss("gspo", check_eps=_check_ratio_eps)
def gspo_loss(inp: SurrogateInputs) -> tuple[Tensor, Tensor]:
    mask = inp.action_mask
    seq_log_ratio = masked_sum_rows(inp.log_ratio.detach(), mask) / mask.sum(dim=1).clamp(min=1)
    log_ratio = inp.logp - inp.logp.detach() + seq_log_ratio.unsqueeze(1)
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
    objective, was_clipped = _clipped_surrogate(ratio, inp)
    return -objective, was_clipped & mask


@register_policy_loss("cispo", check_eps=_check_cispo_eps)
def cispo_loss(inp: SurrogateInputs) -> tuple[Tensor, Tensor]:
    ratio = torch.exp(inp.log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
    weight = ratio.clamp(max=inp.eps_high).detach()
    return -weight * inp.advantages * inp.logp, (ratio > inp.eps_high) & inp.action_mask


@register_policy_loss("reinforce")
def reinforce_loss(inp: SurrogateInputs) -> tuple[Tensor, Tensor]:
    # pi_old plays no part: the gradient is -A grad log pi whatever the policy drifted to since sampling (only
    # the IS coefficient, when on, weighs the sampler's mismatch).
    return -inp.advantages * inp.logp, torch.zeros_like(inp.action_mask)


@dataclass(frozen=True)
class PolicyLossOutput:
    loss: Tensor
    """Scalar: this micro-batch's global token-mean share. Backprop it as is."""
    token_loss: Tensor
    """[B, T] per-token loss after the IS coefficient, zero off the mask (carries the graph)."""
    is_coef: Tensor | None
    """[B, T] detached IS coefficients, or None when IS correction is off."""
    metrics: dict[str, Tensor]
    """Detached 0-dim tensors; see the module docstring."""


class PolicyLoss:
    """``--actor.loss_mode`` surrogate + IS correction + global token-mean, validated at construction."""

    def __init__(
        self,
        loss_mode: str = "ppo",
        *,
        eps_clip: Sequence[float] = (0.2, 0.2),
        dual_clip: float | None = None,
        is_level: str = "off",
        is_mode: str = "mask",
        is_threshold: Sequence[float] = (0.5, 5.0),
        is_gating: str = "ratio",
        score_centering: bool = False,
    ) -> None:
        check_policy_loss(loss_mode, eps_clip, dual_clip)
        check_is_correction(is_level, is_mode, is_threshold, is_gating)
        if score_centering:
            check_score_centering(loss_mode, is_level, is_gating)
        self.score_centering = score_centering
        self.spec = get_policy_loss(loss_mode)
        self.eps_low, self.eps_high = float(eps_clip[0]), float(eps_clip[1])
        self.dual_clip = dual_clip
        self.is_level, self.is_mode, self.is_threshold = is_level, is_mode, tuple(is_threshold)
        self.is_gating = is_gating

    def __call__(
        self,
        logp: Tensor,
        old_logp: Tensor | None,
        advantages: Tensor,
        action_mask: Tensor,
        *,
        num_window_tokens: int,
        dp_size: int = 1,
        rollout_logp: Tensor | None = None,
        entropy: Tensor | None = None,
        row_scale: Tensor | None = None,
        head: SamplerHead | None = None,
    ) -> PolicyLossOutput:
        """Per-micro-batch loss; ``num_window_tokens`` counts the action tokens of the whole
        optimizer-step window over micro-batches and DP ranks (see ``tensor_ops.token_mean``). With
        ``row_scale`` [B] (``aggregation.row_scales`` of another ``--actor.loss_agg_mode``) the rows are
        weighted by it instead of the global token mean. ``head`` (required with score centering, ignored
        otherwise): the sampler's top-k head and the policy's log-probs of it, [B, T, K]."""
        mask = as_bool_mask(action_mask)
        logp = at_least_fp32(logp)  # ratios of bf16 log-probs are too coarse; the cast keeps the graph
        zeros = torch.zeros_like(logp)
        old_logp_given = old_logp is not None
        # force-on-policy: pi_old is this forward, detached
        old_logp = logp.detach() if old_logp is None else at_least_fp32(old_logp)
        log_ratio = torch.where(mask, sanitize_log_ratio(logp - old_logp), zeros)
        adv = torch.nan_to_num(advantages.to(logp.dtype), nan=0.0, posinf=0.0, neginf=0.0)
        inputs = SurrogateInputs(
            logp=torch.where(mask, logp, zeros),
            log_ratio=log_ratio,
            advantages=torch.where(mask, adv, zeros),
            action_mask=mask,
            eps_low=self.eps_low,
            eps_high=self.eps_high,
            dual_clip=self.dual_clip,
        )
        token_loss, was_clipped = self.spec.fn(inputs)
        metrics: dict[str, Tensor] = {}
        is_coef = None
        if self.is_level != "off":
            if rollout_logp is None:
                raise ValueError(
                    "--algo.advantage.is_correction_level is on but the batch has no rollout log-probs; "
                    "request logprobs from vLLM or set --algo.advantage.is_correction_level off"
                )
            correction = is_correction(
                old_logp,
                rollout_logp,
                mask,
                level=self.is_level,
                mode=self.is_mode,
                threshold=self.is_threshold,
                gating=self.is_gating,
            )
            assert correction is not None  # None only for level "off"
            is_coef = correction.coef.to(token_loss.dtype)
            token_loss = token_loss * is_coef
            metrics["vllm_kl"] = correction.vllm_kl
            metrics["is_filter_ratio"] = correction.filter_ratio
        if self.score_centering:
            centred = self._head_correction(head, old_logp_given, mask)
            token_loss = token_loss + inputs.advantages * centred.correction.to(token_loss.dtype)
            metrics["score_centering_sampler_head_mass"] = centred.sampler_head_mass
            metrics["score_centering_policy_head_mass"] = centred.policy_head_mass
        token_loss = torch.where(mask, token_loss, torch.zeros_like(token_loss))
        if row_scale is None:
            loss = token_mean(token_loss, mask, num_window_tokens=num_window_tokens, dp_size=dp_size)
        else:
            loss = scaled_sum(token_loss, mask, row_scale, dp_size=dp_size)
        with torch.no_grad():
            metrics["policy_loss"] = masked_mean(token_loss, mask)
            metrics["policy_clip_ratio"] = masked_mean(was_clipped.to(logp.dtype), mask)
            metrics["policy_kl"] = masked_mean(-log_ratio, mask)
            if entropy is not None:
                metrics["entropy_loss"] = masked_mean(entropy.detach(), mask)
        return PolicyLossOutput(loss=loss, token_loss=token_loss, is_coef=is_coef, metrics=metrics)

    def _head_correction(self, head: SamplerHead | None, old_logp_given: bool, mask: Tensor) -> HeadCorrection:
        if head is None:
            raise ValueError(
                f"{SCORE_CENTERING_FLAG} is on but the batch has no sampler top-k head; the gateway records it "
                "with --rollout.top_logprobs K"
            )
        is_on = self.is_level != "off"
        if is_on and old_logp_given and head.old_logp is None:
            # The sampled token's IS weight compares pi_old with the sampler; the head's must compare the same
            # policy, or the correction no longer cancels the weighted term's mean.
            raise ValueError(
                f"{SCORE_CENTERING_FLAG} with IS correction: pass pi_old's head log-probs (SamplerHead.old_logp) "
                "along with old_logp"
            )
        return head_correction(head, mask, is_mode=self.is_mode if is_on else None, threshold=self.is_threshold)

    def __repr__(self) -> str:
        centred = ", score_centering" if self.score_centering else ""
        return (
            f"PolicyLoss({self.spec.name}, eps=({self.eps_low}, {self.eps_high}), dual_clip={self.dual_clip}, "
            f"is={self.is_level}/{self.is_mode}/{self.is_gating}{list(self.is_threshold)}{centred})"
        )


__all__ = [
    "PolicyLoss",
    "PolicyLossOutput",
    "PolicyLossSpec",
    "SurrogateInputs",
    "check_policy_loss",
    "get_policy_loss",
    "policy_loss_names",
    "register_policy_loss",
]
