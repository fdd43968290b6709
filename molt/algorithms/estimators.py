"""The built-in advantage estimators, registered on import.

Notation: rollout reward r_i, group G with n rollouts, action mask m_t, per-token KL k_t,
beta = ``kl_coef``, gamma / lambda from ``--algo.advantage.gamma`` / ``--algo.advantage.lam``.

- Token-level (each sample is its own rollout): ``reinforce`` (REINFORCE++ discounted return of the
  token reward rho_t = -beta*k_t plus r_i on the last action token), ``gae`` (PPO with a critic) and
  ``on_policy_distill`` (A_t = -beta*k_t, with k = k1 = log pi_student - log pi_teacher).
- Grouped (one scalar per rollout, broadcast to its tokens): ``reinforce_baseline`` and ``dr_grpo``
  (r_i - mean_G), ``grpo`` ((r_i - mean_G) / (sample std_G + 1e-9), singletons get 0) and ``rloo``
  (leave-one-out mean baseline; singletons keep the raw reward).
- Per rollout without groups: ``flash_reinforce`` (r_i - mean of r over every rollout of the batch; no
  std scaling, no whitening: FlashREINFORCE's baseline for one rollout per prompt).

Only ``reinforce``, ``reinforce_baseline`` and ``gae`` are whitened (see ``advantages.py``).
The reverse recursions loop over the step axis with the batch vectorised: T iterations of a few
[B]-sized ops, cheap next to a forward pass.
"""

from __future__ import annotations

import torch
from torch import Tensor

from molt.algorithms.advantages import (
    GRPO_STD_EPS,
    AdvantageBatch,
    group_mean,
    group_size,
    group_std,
    register_advantage_estimator,
)


def token_rewards(batch: AdvantageBatch) -> Tensor:
    """rho_t = -beta * k_t, plus the sample reward on its last action token, times the mask."""
    mask = batch.action_mask
    rho = -batch.kl_coef * batch.kl
    steps = torch.arange(mask.shape[1], dtype=mask.dtype, device=mask.device)
    last_action = (mask * steps).argmax(dim=1)  # rows without actions are zeroed by the mask below
    rho = rho.index_put((torch.arange(mask.shape[0], device=mask.device), last_action), batch.rewards, accumulate=True)
    return rho * mask


def discounted_returns(token_reward: Tensor, gamma: float) -> Tensor:
    """G_t = rho_t + gamma * G_{t+1} over the full step axis (G after the last step = 0)."""
    if gamma == 1.0:
        return token_reward.flip(-1).cumsum(-1).flip(-1)
    returns = torch.zeros_like(token_reward)
    running = torch.zeros_like(token_reward[:, 0])
    for t in range(token_reward.shape[1] - 1, -1, -1):
        running = token_reward[:, t] + gamma * running
        returns[:, t] = running
    return returns


@register_advantage_estimator("reinforce", whitens=True)
def reinforce(batch: AdvantageBatch) -> tuple[Tensor, Tensor]:
    returns = discounted_returns(token_rewards(batch), batch.gamma)
    return returns, returns


@register_advantage_estimator("gae", whitens=True)
def gae(batch: AdvantageBatch) -> tuple[Tensor, Tensor]:
    """delta_t = rho_t + gamma*V_{t+1} - V_t; A_t = delta_t + gamma*lam*A_{t+1}; returns = A + V.

    Positions off the mask (tool outputs between turns, padding) are transparent: the next value and
    the running advantage carry across them unchanged. V after the last action token is 0.
    """
    if batch.values is None:
        raise ValueError("the gae estimator needs critic values (values=[B, T]); is the critic enabled?")
    mask = batch.action_mask
    values = batch.values * mask
    rho = token_rewards(batch)
    advantages = torch.zeros_like(values)
    next_value = torch.zeros_like(values[:, 0])
    next_advantage = torch.zeros_like(values[:, 0])
    is_action = mask.bool()
    for t in range(values.shape[1] - 1, -1, -1):
        delta = rho[:, t] + batch.gamma * next_value - values[:, t]
        adv_t = delta + batch.gamma * batch.lam * next_advantage
        advantages[:, t] = adv_t * mask[:, t]
        next_value = torch.where(is_action[:, t], values[:, t], next_value)
        next_advantage = torch.where(is_action[:, t], adv_t, next_advantage)
    return advantages, (advantages + values) * mask


@register_advantage_estimator("on_policy_distill")
def on_policy_distill(batch: AdvantageBatch) -> tuple[Tensor, Tensor]:
    """Dense per-token reward from the teacher: A_t = -beta * k1_t; no baseline, no discount."""
    advantages = -batch.kl_coef * batch.kl * batch.action_mask
    return advantages, advantages


@register_advantage_estimator("reinforce_baseline", grouped=True, whitens=True)
def reinforce_baseline(batch: AdvantageBatch) -> tuple[Tensor, Tensor]:
    r, g = batch.rollout_rewards, batch.rollout_group
    advantages = batch.broadcast(r - group_mean(r, g))
    return advantages, advantages


@register_advantage_estimator("dr_grpo", grouped=True)
def dr_grpo(batch: AdvantageBatch) -> tuple[Tensor, Tensor]:
    r, g = batch.rollout_rewards, batch.rollout_group
    advantages = batch.broadcast(r - group_mean(r, g))
    return advantages, advantages


@register_advantage_estimator("grpo", grouped=True)
def grpo(batch: AdvantageBatch) -> tuple[Tensor, Tensor]:
    r, g = batch.rollout_rewards, batch.rollout_group
    advantages = batch.broadcast((r - group_mean(r, g)) / (group_std(r, g) + GRPO_STD_EPS))
    return advantages, advantages


@register_advantage_estimator("rloo", grouped=True)
def rloo(batch: AdvantageBatch) -> tuple[Tensor, Tensor]:
    r, g = batch.rollout_rewards, batch.rollout_group
    n = group_size(r, g)
    leave_one_out = (group_mean(r, g) * n - r) / (n - 1).clamp(min=1)
    per_rollout = torch.where(n > 1, r - leave_one_out, r)
    advantages = batch.broadcast(per_rollout)
    return advantages, advantages


@register_advantage_estimator("flash_reinforce", per_rollout=True)
def flash_reinforce(batch: AdvantageBatch) -> tuple[Tensor, Tensor]:
    r = batch.rollout_rewards
    advantages = batch.broadcast(r - r.mean()) if r.numel() else batch.action_mask * 0.0
    return advantages, advantages


__all__ = ["discounted_returns", "token_rewards"]
