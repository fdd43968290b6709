"""Importance-sampling correction for the train/rollout mismatch (Molt spec 5).

Rollouts are sampled by vLLM, whose log-probs differ from the trainer's (kernels, precision, and in
async mode older weights). The per-token unit ratio compares the trainer's *old* log-probs (pi_old,
or the detached current forward under force-on-policy) with vLLM's rollout log-probs:

    delta_t = log pi_old - log pi_rollout   (NaN -> 0, +-inf -> +-30, clamped to +-30)
    w_t     = exp(delta_t)                  (detached)

A *level* picks what is compared to the band [low, high] and a *mode* what is done about it:

    level  unit ratio u                      mode   coefficient c_t on the per-token loss
    token  u_t = w_t                         mask   w_t if low <= u <= high else 0
    seq    u = exp(clamp(sum_t delta_t))     clip   clamp(u, low, high)     (token level only)
    geo    u = exp(mean_t delta_t)           trunc  min(u, high)            (token level only)

``seq``/``geo`` reject whole sequences, and survivors keep their *per-token* w_t. Filtered tokens
keep counting in the token-mean denominator. Named schemes: token+trunc = TIS, token+mask =
IcePop, geo+mask = seq-mask-tis / MIS, seq+mask = product rejection. ``off`` disables all of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from molt.algorithms.tensor_ops import (
    LOG_RATIO_LIMIT,
    as_bool_mask,
    at_least_fp32,
    masked_mean,
    sanitize_log_ratio,
)

IS_LEVELS: tuple[str, ...] = ("off", "token", "seq", "geo")
IS_MODES: tuple[str, ...] = ("mask", "clip", "trunc")
LEVEL_FLAG = "--algo.advantage.is_correction_level"
MODE_FLAG = "--algo.advantage.is_correction_mode"
THRESHOLD_FLAG = "--algo.advantage.is_correction_threshold"


def check_is_correction(level: str, mode: str, threshold: Sequence[float]) -> None:
    """Raise ``ValueError`` (naming the flags) for an unknown or unsupported level/mode/threshold."""
    if level not in IS_LEVELS:
        raise ValueError(f"{LEVEL_FLAG} {level!r} is unknown; choose one of {', '.join(IS_LEVELS)}")
    if mode not in IS_MODES:
        raise ValueError(f"{MODE_FLAG} {mode!r} is unknown; choose one of {', '.join(IS_MODES)}")
    if level in ("seq", "geo") and mode != "mask":
        raise ValueError(
            f"{LEVEL_FLAG} {level} supports only {MODE_FLAG} mask (got {mode}): a sequence-level ratio can "
            f"only accept or reject whole sequences. Use {MODE_FLAG} mask, or {LEVEL_FLAG} token for clip/trunc"
        )
    if len(threshold) != 2:
        raise ValueError(f"{THRESHOLD_FLAG} takes two values LOW HIGH, got {list(threshold)}")
    low, high = threshold
    if not 0 <= low <= high or high <= 0:
        raise ValueError(f"{THRESHOLD_FLAG} needs 0 <= LOW <= HIGH and HIGH > 0, got {low} {high} (default 0.5 5.0)")


@dataclass(frozen=True)
class ISCorrection:
    coef: Tensor
    """[B, T] detached coefficient multiplying the per-token loss (0 off the mask)."""
    filtered: Tensor
    """[B, T] bool (token level) or [B] bool (seq/geo): the units counted in ``is_filter_ratio``."""
    filter_ratio: Tensor
    """0-dim: masked fraction of filtered tokens (token) or of filtered sequences (seq/geo)."""
    vllm_kl: Tensor
    """0-dim: masked mean of (log pi_rollout - log pi_old), a signed k1 estimate of the mismatch."""


def is_correction(
    old_logp: Tensor,
    rollout_logp: Tensor,
    action_mask: Tensor,
    *,
    level: str,
    mode: str,
    threshold: Sequence[float] = (0.5, 5.0),
) -> ISCorrection | None:
    """Coefficients for ``level``/``mode`` (``None`` when level is ``off``); inputs on the step axis."""
    check_is_correction(level, mode, threshold)
    if level == "off":
        return None
    low, high = float(threshold[0]), float(threshold[1])
    mask = as_bool_mask(action_mask)
    with torch.no_grad():
        raw = sanitize_log_ratio(at_least_fp32(old_logp - rollout_logp)).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
        delta = torch.where(mask, raw, torch.zeros_like(raw))
        token_weight = torch.exp(delta)
        has_actions = mask.any(dim=1)
        if level == "token":
            unit = token_weight
        else:
            log_unit = delta.sum(dim=1)
            if level == "geo":
                log_unit = log_unit / mask.sum(dim=1).clamp(min=1)
            unit = torch.exp(log_unit.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
        if mode == "mask":
            keep = (unit >= low) & (unit <= high)
            filtered = ~keep
            coef = token_weight * (keep if level == "token" else keep.unsqueeze(1))
        elif mode == "clip":
            filtered = (unit < low) | (unit > high)
            coef = unit.clamp(low, high)
        else:  # trunc
            filtered = unit > high
            coef = unit.clamp(max=high)
        coef = coef * mask
        if level == "token":
            filter_ratio = masked_mean(filtered.float(), mask)
        else:
            filter_ratio = masked_mean(filtered.float(), has_actions)
        vllm_kl = -masked_mean(delta, mask)
    return ISCorrection(coef=coef, filtered=filtered, filter_ratio=filter_ratio, vllm_kl=vllm_kl)


__all__ = ["IS_LEVELS", "IS_MODES", "ISCorrection", "check_is_correction", "is_correction"]
