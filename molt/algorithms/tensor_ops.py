"""Masked reductions and sanitisers shared by the advantage, KL, policy and value code.

Everything here works on the *step axis* (``[B, T]``, step k predicts token k+1) with an action mask
that is True on tokens the policy generated. Two reductions exist and they are not interchangeable:

- ``masked_mean``: a plain mean over the action tokens of the tensors at hand. Used for *metrics*
  (``policy_loss``, ``policy_kl``, ``vllm_kl``, ...), never for the quantity that is backpropagated.
- ``token_mean``: Molt's *global token-mean*, the per-micro-batch share of one mean over every action
  token of the optimizer-step window (all micro-batches, all data-parallel ranks)::

      contribution = sum(loss * mask) / num_window_tokens * dp_size

  Summing the contributions over the window's micro-batches (gradient accumulation) and averaging
  gradients over ``dp_size`` ranks (what DDP/FSDP do) yields exactly the gradient of
  ``sum(all losses) / num_window_tokens``: long and short micro-batches weigh by their token count,
  not 1/num_micro_batches each. There is no division by the accumulation step count.

Log-ratios arrive from bf16 forwards and from another engine (vLLM), so they can hold NaN or
+-inf; ``sanitize_log_ratio`` maps NaN to 0 and +-inf to +-30 before anything exponentiates them.
"""

from __future__ import annotations

import torch
from torch import Tensor

LOG_RATIO_LIMIT = 30.0
"""Bound for log-ratios fed to exp(): e^30 ~ 1e13 stays finite in fp32."""


def sanitize_log_ratio(log_ratio: Tensor) -> Tensor:
    """NaN -> 0, +inf -> +30, -inf -> -30; finite values pass unchanged (no clamp)."""
    return torch.nan_to_num(log_ratio, nan=0.0, posinf=LOG_RATIO_LIMIT, neginf=-LOG_RATIO_LIMIT)


def at_least_fp32(x: Tensor) -> Tensor:
    """Half-precision (bf16/fp16) tensors are upcast to fp32; fp32/fp64 pass unchanged."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def as_bool_mask(action_mask: Tensor) -> Tensor:
    """Accept a bool or 0/1 mask; return bool."""
    return action_mask if action_mask.dtype == torch.bool else action_mask != 0


def masked_sum(values: Tensor, action_mask: Tensor) -> Tensor:
    """Sum of ``values`` over action tokens; NaN/inf at masked-out positions cannot leak in."""
    mask = as_bool_mask(action_mask)
    return torch.where(mask, values, torch.zeros_like(values)).sum()


def masked_mean(values: Tensor, action_mask: Tensor) -> Tensor:
    """Mean of ``values`` over action tokens (0 when there are none). For metrics."""
    mask = as_bool_mask(action_mask)
    count = mask.sum()
    total = masked_sum(values, mask)
    return total / count.clamp(min=1).to(total.dtype)


def token_mean(token_loss: Tensor, action_mask: Tensor, *, num_window_tokens: int, dp_size: int = 1) -> Tensor:
    """Global token-mean share of this micro-batch: ``sum(loss*mask) / num_window_tokens * dp_size``.

    ``num_window_tokens`` is the action-token count of the whole optimizer-step window, summed over
    micro-batches and data-parallel ranks (context-parallel shards excluded). With 0 tokens in the
    window the result is a graph-connected 0, so ``backward()`` still works.
    """
    if num_window_tokens < 0 or dp_size < 1:
        raise ValueError(f"num_window_tokens must be >= 0 and dp_size >= 1, got {num_window_tokens}, {dp_size}")
    total = masked_sum(token_loss, action_mask)
    if num_window_tokens == 0:
        return total * 0.0
    return total * (dp_size / num_window_tokens)


def scaled_sum(token_loss: Tensor, action_mask: Tensor, row_scale: Tensor, *, dp_size: int = 1) -> Tensor:
    """This micro-batch's share of a window loss with per-row weights: ``sum_i s_i * sum_t loss_it * dp_size``.

    ``row_scale`` [B] comes from ``aggregation.row_scales``, computed once over the whole window (all
    micro-batches and ranks; ``sum_i s_i * n_i = 1`` for n_i action tokens per row), so accumulation and DP
    averaging give the window's loss exactly, as ``token_mean`` does for the token mean.
    """
    per_row = torch.where(as_bool_mask(action_mask), token_loss, torch.zeros_like(token_loss)).sum(dim=-1)
    return (per_row * row_scale.to(per_row.dtype)).sum() * dp_size


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Per-position entropy (nats) of softmax(logits) over the last axis: ``[..., V] -> [...]``.

    Pass temperature-scaled logits (logits / T), like the log-probs the loss sees.
    """
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    probs = log_probs.exp()
    # Vocab entries masked to -inf have p = 0 and contribute 0 (not 0 * -inf = NaN), also in backward.
    safe_log_probs = torch.where(probs > 0, log_probs, torch.zeros_like(log_probs))
    return -(probs * safe_log_probs).sum(dim=-1)


__all__ = [
    "LOG_RATIO_LIMIT",
    "as_bool_mask",
    "at_least_fp32",
    "entropy_from_logits",
    "masked_mean",
    "masked_sum",
    "sanitize_log_ratio",
    "scaled_sum",
    "token_mean",
]
