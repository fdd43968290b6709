"""Clipped value loss for the PPO critic (``gae`` estimator).

The critic's new prediction V may move at most ``value_clip`` (``--critic.value_clip``, default 0.2)
away from the value it predicted at rollout time (V_old) before the clipped branch takes over; the
loss keeps the worse of the two branches (PPO's pessimism, applied to the regression target R =
the un-whitened ``returns`` from ``compute_advantages``)::

    V_clip = V_old + clamp(V - V_old, -value_clip, value_clip)
    loss_t = 1/2 * max((V - R)^2, (V_clip - R)^2)        (value_clip=None: 1/2 * (V - R)^2)

Aggregated with the same global token-mean as the policy loss. Metrics: ``value_loss`` (plain masked
mean) and ``value_clip_frac`` (masked fraction with |V - V_old| > value_clip).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from molt.algorithms.tensor_ops import as_bool_mask, at_least_fp32, masked_mean, token_mean

DEFAULT_VALUE_CLIP = 0.2


@dataclass(frozen=True)
class ValueLossOutput:
    loss: Tensor
    """Scalar: this micro-batch's global token-mean share. Backprop it as is."""
    token_loss: Tensor
    """[B, T] per-token loss, zero off the mask."""
    metrics: dict[str, Tensor]
    """Detached 0-dim tensors: ``value_loss``, ``value_clip_frac``."""


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    action_mask: Tensor,
    *,
    value_clip: float | None = DEFAULT_VALUE_CLIP,
    num_window_tokens: int,
    dp_size: int = 1,
) -> ValueLossOutput:
    """Clipped critic loss on step-axis tensors; see the module docstring."""
    if value_clip is not None and value_clip <= 0:
        raise ValueError(f"--critic.value_clip must be > 0 (or unset for no clipping), got {value_clip}")
    mask = as_bool_mask(action_mask)
    # As Molt: the squared errors are taken in fp32 even for a bf16 critic head, whose 8 mantissa bits
    # would round small value errors away (the cast keeps the graph back to the bf16 values).
    values = at_least_fp32(values)
    old_values = old_values.to(values.dtype)
    returns = returns.to(values.dtype)
    unclipped = (values - returns) ** 2
    if value_clip is None:
        token_loss = 0.5 * unclipped
        clip_frac = values.new_zeros(())
    else:
        clipped_values = old_values + (values - old_values).clamp(-value_clip, value_clip)
        token_loss = 0.5 * torch.maximum(unclipped, (clipped_values - returns) ** 2)
        with torch.no_grad():
            clip_frac = masked_mean(((values - old_values).abs() > value_clip).to(values.dtype), mask)
    token_loss = torch.where(mask, token_loss, torch.zeros_like(token_loss))
    loss = token_mean(token_loss, mask, num_window_tokens=num_window_tokens, dp_size=dp_size)
    with torch.no_grad():
        metrics = {"value_loss": masked_mean(token_loss, mask), "value_clip_frac": clip_frac}
    return ValueLossOutput(loss=loss, token_loss=token_loss, metrics=metrics)


__all__ = ["DEFAULT_VALUE_CLIP", "ValueLossOutput", "value_loss"]
