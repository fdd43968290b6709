"""Importance-sampling correction for the train/rollout mismatch.

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

A *gating* other than ``ratio`` compares a divergence between the two policies' probabilities of the
sampled token (p = pi_rollout, q = pi_old, both clamped to [1e-6, 1 - 1e-6]) with the band instead of the
ratio: ``binary_kl`` d_t = p log(p/q) + (1-p) log((1-p)/(1-q)), ``tv`` d_t = |p - q|. At ``token`` level
the unit is d_t, at ``seq``/``geo`` level its mean over the sequence's action tokens. Only ``mask`` applies
(a divergence is a filter, not a weight): survivors keep w_t, and the band is an upper bound [0, delta].
``seq`` + ``binary_kl`` with delta = 5e-3 is FlashREINFORCE's trust region.
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
IS_GATINGS: tuple[str, ...] = ("ratio", "binary_kl", "tv")
LEVEL_FLAG = "--algo.advantage.is_correction_level"
MODE_FLAG = "--algo.advantage.is_correction_mode"
GATING_FLAG = "--algo.advantage.is_correction_gating"
THRESHOLD_FLAG = "--algo.advantage.is_correction_threshold"
PROB_CLAMP = 1e-6
"""Probabilities are kept in [PROB_CLAMP, 1 - PROB_CLAMP] so the binary KL's logs stay finite."""


def check_is_correction(level: str, mode: str, threshold: Sequence[float], gating: str = "ratio") -> None:
    """Raise ``ValueError`` (naming the flags) for an unknown or unsupported level/mode/gating/threshold."""
    if level not in IS_LEVELS:
        raise ValueError(f"{LEVEL_FLAG} {level!r} is unknown; choose one of {', '.join(IS_LEVELS)}")
    if mode not in IS_MODES:
        raise ValueError(f"{MODE_FLAG} {mode!r} is unknown; choose one of {', '.join(IS_MODES)}")
    if gating not in IS_GATINGS:
        raise ValueError(f"{GATING_FLAG} {gating!r} is unknown; choose one of {', '.join(IS_GATINGS)}")
    if gating != "ratio" and level != "off":
        if mode != "mask":
            raise ValueError(
                f"{GATING_FLAG} {gating} supports only {MODE_FLAG} mask (got {mode}): a divergence rejects tokens "
                f"or sequences, it is not a weight to clamp. Use {MODE_FLAG} mask, or {GATING_FLAG} ratio"
            )
        if len(threshold) == 2 and threshold[0] > 0:
            raise ValueError(
                f"{GATING_FLAG} {gating} takes an upper bound only: pass {THRESHOLD_FLAG} DELTA (one value, "
                f"e.g. 5e-3), got {list(threshold)} (the ratio band's default 0.5 5.0 would reject every sequence)"
            )
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
    gating: str = "ratio",
) -> ISCorrection | None:
    """Coefficients for ``level``/``mode``/``gating`` (``None`` when level is ``off``); inputs on the step axis."""
    check_is_correction(level, mode, threshold, gating)
    if level == "off":
        return None
    low, high = float(threshold[0]), float(threshold[1])
    mask = as_bool_mask(action_mask)
    with torch.no_grad():
        raw = sanitize_log_ratio(at_least_fp32(old_logp - rollout_logp)).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
        delta = torch.where(mask, raw, torch.zeros_like(raw))
        token_weight = torch.exp(delta)
        has_actions = mask.any(dim=1)
        if gating != "ratio":
            unit = _divergence(old_logp, rollout_logp, gating)
            unit = torch.where(mask, unit, torch.zeros_like(unit))
            if level != "token":
                unit = unit.sum(dim=1) / mask.sum(dim=1).clamp(min=1)
        elif level == "token":
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


def _divergence(old_logp: Tensor, rollout_logp: Tensor, gating: str) -> Tensor:
    """Per-token binary KL or total variation between pi_rollout (p) and pi_old (q) of the sampled token."""
    p = at_least_fp32(rollout_logp).nan_to_num(nan=0.0).exp().clamp(PROB_CLAMP, 1 - PROB_CLAMP)
    q = at_least_fp32(old_logp).nan_to_num(nan=0.0).exp().clamp(PROB_CLAMP, 1 - PROB_CLAMP)
    if gating == "tv":
        return (p - q).abs()
    # Rounding can leave a tiny negative KL where p ~ q; a band [0, delta] must keep those tokens.
    return (p * (p.log() - q.log()) + (1 - p) * (torch.log1p(-p) - torch.log1p(-q))).clamp(min=0.0)


__all__ = ["IS_GATINGS", "IS_LEVELS", "IS_MODES", "ISCorrection", "check_is_correction", "is_correction"]
