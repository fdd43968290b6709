"""Length shaping of rewards, before the reward clip and the advantage estimator (Molt's ``--reward.*`` flags).

Two penalties, each off unless its flag is set, applied once per rollout (every segment of a multi-segment
rollout shares its rollout's shaped reward):

* **overlong** (``--reward.overlong_buffer_len L``, ``--reward.overlong_penalty_factor f``): a rollout whose
  longest segment reaches into the last ``L`` tokens of the context (``--data.max_len``) loses
  ``f * min(length - (max_len - L), L) / L``. The longest segment, not the sum: a rollout that compacted its
  context used several windows, and each window is what had to fit.
* **stop properly** (``--reward.stop_properly_penalty_coef c``): a truncated rollout (any segment cut by the
  length limit, or an episode the env or agent reported truncated) has its reward, after the overlong
  penalty, scaled by ``c`` when ``0 <= c <= 1``, or replaced by ``c`` when ``c < 0``.

Estimators that treat each sample as its own rollout (``reinforce``, ``gae``) shape each segment on its own.
The raw reward stays what the agent returned; the parts come back for logging.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

PARTS = ("length_penalty", "overlong_penalty", "stop_properly_penalty")


@dataclass(frozen=True)
class LengthShaping:
    context_len: int
    """The context budget of a rollout (``--data.max_len``)."""
    overlong_buffer_len: float | None = None
    overlong_penalty_factor: float = 1.0
    stop_properly_penalty_coef: float | None = None

    @classmethod
    def of(cls, reward, context_len: int) -> LengthShaping:
        """From the ``--reward.*`` section (``RewardConfig``) and ``--data.max_len``."""
        return cls(
            context_len, reward.overlong_buffer_len, reward.overlong_penalty_factor, reward.stop_properly_penalty_coef
        )

    @property
    def enabled(self) -> bool:
        return self.overlong_buffer_len is not None or self.stop_properly_penalty_coef is not None

    def problems(self) -> list[str]:
        """What is wrong with these settings, each naming its flag (empty: fine)."""
        out = []
        buf = self.overlong_buffer_len
        if buf is not None and not (math.isfinite(buf) and 0 < buf < self.context_len):
            out.append(
                f"--reward.overlong_buffer_len must be finite and in (0, --data.max_len {self.context_len}), got {buf}"
            )
        factor = self.overlong_penalty_factor
        if not (math.isfinite(factor) and factor >= 0):
            out.append(f"--reward.overlong_penalty_factor must be finite and >= 0, got {factor}")
        coef = self.stop_properly_penalty_coef
        if coef is not None and not (math.isfinite(coef) and coef <= 1):
            out.append(
                f"--reward.stop_properly_penalty_coef must be finite and <= 1 (0..1 scales a truncated rollout's "
                f"reward, below 0 replaces it), got {coef}"
            )
        return out


def shape_rewards(
    rewards: Tensor,
    lengths: Sequence[int],
    truncated: Sequence[bool],
    rollout_keys: Sequence[str],
    shaping: LengthShaping,
) -> tuple[Tensor, dict[str, Tensor]]:
    """(shaped rewards [B], {part: [B]}) for ``rewards [B]`` of samples with ``lengths`` (tokens in the
    segment's context) and ``truncated`` flags; samples with equal ``rollout_keys`` are one rollout (its
    reward is its first sample's). Disabled: the rewards unchanged and no parts."""
    if not shaping.enabled:
        return rewards, {}
    index: dict[str, int] = {}
    first: list[int] = []
    longest: list[int] = []
    cut: list[bool] = []
    sample_rollout: list[int] = []
    for i, key in enumerate(rollout_keys):
        r = index.setdefault(key, len(first))
        if r == len(first):
            first.append(i)
            longest.append(lengths[i])
            cut.append(bool(truncated[i]))
        else:
            longest[r] = max(longest[r], lengths[i])
            cut[r] = cut[r] or bool(truncated[i])
        sample_rollout.append(r)
    raw = rewards[torch.tensor(first, dtype=torch.long)].double()
    overlong = torch.zeros_like(raw)
    buf = shaping.overlong_buffer_len
    if buf is not None:
        exceed = (torch.tensor(longest, dtype=torch.float64) - (shaping.context_len - buf)).clamp(0, buf)
        overlong = -exceed / buf * shaping.overlong_penalty_factor
    after_overlong = raw + overlong
    shaped = after_overlong
    coef = shaping.stop_properly_penalty_coef
    if coef is not None:
        is_cut = torch.tensor(cut)
        stopped = torch.full_like(raw, coef) if coef < 0 else after_overlong * coef
        shaped = torch.where(is_cut, stopped, after_overlong)
    per_sample = torch.tensor(sample_rollout, dtype=torch.long)
    dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    parts = {
        "length_penalty": shaped - raw,
        "overlong_penalty": overlong,
        "stop_properly_penalty": shaped - after_overlong,
    }
    return shaped[per_sample].to(dtype), {k: v[per_sample].to(dtype) for k, v in parts.items()}


def shaping_metrics(rollout_keys: Sequence[str], parts: Mapping[str, Sequence[float]]) -> dict[str, float]:
    """A step's metrics from each sample's ``parts``: every part's mean over rollouts (a rollout counts as the
    mean of its segments) and ``rollout/overlong_frac``, the share of rollouts with an overlong penalty.
    Rollouts, not segments: a compacted rollout counts once."""
    if not parts:
        return {}
    by_rollout: dict[str, dict[str, list[float]]] = {}
    for i, key in enumerate(rollout_keys):
        slot = by_rollout.setdefault(key, {name: [] for name in parts})
        for name, values in parts.items():
            slot[name].append(values[i])
    rollouts = list(by_rollout.values())
    out = {name: sum(sum(r[name]) / len(r[name]) for r in rollouts) / len(rollouts) for name in parts}
    out["rollout/overlong_frac"] = sum(min(r["overlong_penalty"]) < 0 for r in rollouts) / len(rollouts)
    return out
