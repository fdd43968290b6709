"""Score centering for REINFORCE (``--actor.score_centering``): the sampler's top-k head as a control variate.

Per action step, with y the sampled token, q the sampler's distribution (the rollout engine's, as recorded),
p the trained policy, H the sampler's top-k ids recorded for that step, A the advantage and f the per-token
weight of the IS correction (off: 1; token level: ``mask`` r*1[low <= r <= high], ``clip`` clamp(r, low, high),
``trunc`` min(r, high))::

    loss_t = -A f(p_y/q_y) log p_y  +  A sum_{v in H} sg[c_v] log p_v
    c_v    = q_v f(p_v/q_v) - alpha p_v
    rho    = max(1 - sum_H q, eps) / max(1 - sum_H p, eps),   alpha = rho f(1/rho),   eps = 1e-6

Only the log p_v (log-probs over the whole vocabulary, on logits / temperature) carry gradient. On the logits,
with f = 1, the step's gradient is -A (onehot(y) - q_hat), q_hat = q on H and rho p off H (q's off-head mass
spread like p's, so q_hat sums to 1): the sampled token's score is centred on the sampler's distribution
instead of the policy's. With H the whole vocabulary that is -A (onehot(y) - q), and for a fixed A its
expectation over y ~ q is 0 for every f (the head sum is the weighted term's mean). Where q equals p on H the
correction is 0 and the loss is plain REINFORCE.

Which p: the IS weights f(p/q), of the sampled token and of the head alike, compare pi_old with the sampler, as
``is_correction`` does (``SamplerHead.old_logp``; under force-on-policy the detached current forward), so the
sampled token's weight is exactly the IS coefficient. rho and the alpha p_v term use the current policy
(detached): that is what makes the centring exact for the gradient taken at the current policy.

Valid with ``--actor.loss_mode reinforce`` and IS correction off or at token level with the ratio gating
(``check_score_centering``): a sequence-level or divergence-gated coefficient has no per-token f the head could
share. Only ``log p`` of the head ids is needed, so the trainer gathers K columns of the log-softmax it computes
anyway.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from molt.algorithms.is_correction import GATING_FLAG, LEVEL_FLAG, MODE_FLAG
from molt.algorithms.tensor_ops import LOG_RATIO_LIMIT, as_bool_mask, at_least_fp32, masked_mean, sanitize_log_ratio

SCORE_CENTERING_FLAG = "--actor.score_centering"
HEAD_EPS = 1e-6
"""Floor of the off-head masses in rho: a head holding (nearly) all of q's or p's mass gives rho = 1, not 0/0."""


@dataclass(frozen=True)
class SamplerHead:
    """The sampler's top-k head of every step, each tensor [B, T, K] on the step axis (K: the batch's largest)."""

    logp: Tensor
    """The policy's log-probs of the head ids over the whole vocabulary (carries the gradient)."""
    sampler_logp: Tensor
    """The sampler's recorded log-probs of the head ids (-inf allowed: a token its settings rule out)."""
    mask: Tensor
    """bool: a real head entry; False on padding (a shorter K, a step without a recorded row)."""
    old_logp: Tensor | None = None
    """pi_old's log-probs of the head ids, for the IS weights; None: ``logp`` detached (force-on-policy)."""


@dataclass(frozen=True)
class HeadCorrection:
    correction: Tensor
    """[B, T]: sum_H sg[c_v] log p_v, 0 off the action mask (carries the graph); the loss adds A times it."""
    sampler_head_mass: Tensor
    """0-dim, detached: mean over action steps of sum_H q."""
    policy_head_mass: Tensor
    """0-dim, detached: mean over action steps of sum_H p."""


def check_score_centering(loss_mode: str, is_level: str, is_gating: str = "ratio") -> None:
    """Raise ``ValueError`` naming the flags for a loss or IS setting score centering cannot be combined with."""
    if loss_mode != "reinforce":
        raise ValueError(
            f"{SCORE_CENTERING_FLAG} centres REINFORCE's score and works only with --actor.loss_mode reinforce "
            f"(got {loss_mode}); pass --actor.loss_mode reinforce or drop {SCORE_CENTERING_FLAG}"
        )
    if is_level not in ("off", "token"):
        raise ValueError(
            f"{SCORE_CENTERING_FLAG} weighs every head token by the sampled token's per-token IS weight: it needs "
            f"{LEVEL_FLAG} off or token (got {is_level}, which accepts or rejects whole sequences)"
        )
    if is_level != "off" and is_gating != "ratio":
        raise ValueError(
            f"{SCORE_CENTERING_FLAG} needs {GATING_FLAG} ratio (got {is_gating}): a divergence gate filters the "
            f"sampled token alone and gives the head no weight f(p/q) to share; use {GATING_FLAG} ratio with "
            f"{MODE_FLAG} mask, clip or trunc"
        )


def ratio_weight(ratio: Tensor, mode: str | None, threshold: Sequence[float] = (0.5, 5.0)) -> Tensor:
    """f(r) of a token-level, ratio-gated IS correction (``mode`` None: IS off, f = 1); same formulas as
    ``is_correction`` at token level, so the head and the sampled token share one cap."""
    low, high = float(threshold[0]), float(threshold[1])
    if mode is None:
        return torch.ones_like(ratio)
    if mode == "mask":
        return ratio * ((ratio >= low) & (ratio <= high))
    if mode == "clip":
        return ratio.clamp(low, high)
    if mode == "trunc":
        return ratio.clamp(max=high)
    raise ValueError(f"{MODE_FLAG} {mode!r} is unknown; choose one of mask, clip, trunc")


def head_correction(
    head: SamplerHead,
    action_mask: Tensor,
    *,
    is_mode: str | None = None,
    threshold: Sequence[float] = (0.5, 5.0),
) -> HeadCorrection:
    """The per-step correction term of the module docstring (``is_mode`` None: IS correction off)."""
    steps = as_bool_mask(action_mask)
    mask = as_bool_mask(head.mask) & steps.unsqueeze(-1)
    logp = at_least_fp32(head.logp)
    zeros = torch.zeros_like(logp)
    # A policy log-prob of -inf (a logit masked by the model) has p = 0 and no score: left out, not 0 * -inf.
    live = mask & torch.isfinite(logp)
    with torch.no_grad():
        sampler = at_least_fp32(head.sampler_logp).to(logp.dtype)
        sampler = torch.where(torch.isnan(sampler), torch.full_like(sampler, -torch.inf), sampler)
        p = torch.where(live, logp.detach().exp(), zeros)
        q = torch.where(mask, sampler.exp(), zeros)  # -inf -> 0: in H, with no sampler mass
        sampler_mass, policy_mass = q.sum(-1), p.sum(-1)
        rho = (1 - sampler_mass).clamp(min=HEAD_EPS) / (1 - policy_mass).clamp(min=HEAD_EPS)
        if is_mode is None:
            weighted_q, alpha = q, rho
        else:
            base = logp.detach() if head.old_logp is None else at_least_fp32(head.old_logp).to(logp.dtype)
            log_ratio = sanitize_log_ratio(base - sampler).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
            weighted_q = q * ratio_weight(log_ratio.exp(), is_mode, threshold)
            alpha = rho * ratio_weight(1 / rho, is_mode, threshold)
        coef = torch.where(mask, weighted_q - alpha.unsqueeze(-1) * p, zeros)
    correction = (coef * torch.where(live, logp, zeros)).sum(-1)
    correction = torch.where(steps, correction, torch.zeros_like(correction))
    return HeadCorrection(
        correction=correction,
        sampler_head_mass=masked_mean(sampler_mass, steps),
        policy_head_mass=masked_mean(policy_mass, steps),
    )


__all__ = [
    "HEAD_EPS",
    "SCORE_CENTERING_FLAG",
    "HeadCorrection",
    "SamplerHead",
    "check_score_centering",
    "head_correction",
    "ratio_weight",
]
