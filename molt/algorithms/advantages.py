"""Advantage estimators behind a name registry, and the one entry point the trainer calls.

``compute_advantages(name, rewards[B], action_mask[B, T], ...)`` runs the same pipeline for every
estimator:

1. rewards are clipped to ``reward_clip`` (``--reward.clip_range``) *before* the estimator;
2. the batch is indexed into rollouts and groups. *Grouped* estimators (``grpo``, ``dr_grpo``, ``rloo``,
   ``reinforce_baseline``) and *per-rollout* ones (``flash_reinforce``) merge the samples of one
   ``rollout_id`` (a multi-segment rollout: first-seen reward) so it counts once in its baseline, group
   rollouts by ``group_id``, and broadcast each rollout's scalar advantage to every action token of each of
   its segments. The other estimators treat each sample as its own rollout and group;
3. the estimator returns ``(advantages, returns)`` with ``returns`` = advantages before whitening;
4. estimators registered with ``whitens=True`` (``reinforce``, ``reinforce_baseline``, ``gae``) are
   whitened over all action tokens of the batch unless ``whiten=False`` (``--algo.advantage.no_whiten``);
   ``std_norm=False`` (``--algo.advantage.no_std_norm``) keeps the mean subtraction and skips the division.

Both outputs are zero off the action mask (Molt leaves whitened values at masked positions; the loss
ignores them either way, zeros keep masked means honest). A new estimator is one decorated function::

    @register_advantage_estimator("my_est", grouped=True)
    def my_est(batch: AdvantageBatch) -> tuple[Tensor, Tensor]:
        per_rollout = batch.rollout_rewards - group_mean(batch.rollout_rewards, batch.rollout_group)
        adv = batch.broadcast(per_rollout)
        return adv, adv

after which ``--algo.advantage.estimator my_est`` works without touching the trainer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from molt.algorithms.tensor_ops import as_bool_mask

WHITEN_VAR_FLOOR = 1e-8
GRPO_STD_EPS = 1e-9


@dataclass(frozen=True)
class AdvantageBatch:
    """What an estimator sees. ``R`` rollouts (after merging segments), ``G`` groups."""

    rewards: Tensor
    """[B] clipped reward of each sample (segments of one rollout repeat the rollout's reward)."""
    action_mask: Tensor
    """[B, T] float 0/1 on the step axis."""
    kl: Tensor
    """[B, T] per-token KL (zeros when none was given)."""
    values: Tensor | None
    """[B, T] critic values (``gae`` only)."""
    gamma: float
    lam: float
    kl_coef: float
    """beta, the KL controller's current value."""
    rollout_rewards: Tensor
    """[R] one reward per rollout."""
    rollout_group: Tensor
    """[R] int64 group index in [0, G) of each rollout."""
    sample_rollout: Tensor
    """[B] int64 rollout index of each sample."""

    def broadcast(self, per_rollout: Tensor) -> Tensor:
        """[R] scalar per rollout -> [B, T] on every action token of every segment of that rollout."""
        return per_rollout[self.sample_rollout].unsqueeze(-1) * self.action_mask


AdvantageFn = Callable[[AdvantageBatch], tuple[Tensor, Tensor]]


@dataclass(frozen=True)
class AdvantageEstimator:
    name: str
    fn: AdvantageFn
    grouped: bool
    """Needs groups of several rollouts per prompt (``--rollout.n_samples_per_prompt > 1``)."""
    whitens: bool
    """Whitened over the batch unless ``--algo.advantage.no_whiten``."""
    per_rollout: bool = False
    """One scalar per rollout (segments merged) without needing groups, e.g. a batch-mean baseline."""


_ESTIMATORS: dict[str, AdvantageEstimator] = {}


def register_advantage_estimator(
    name: str, *, grouped: bool = False, whitens: bool = False, per_rollout: bool = False
):
    """Decorator adding an estimator under ``name``; re-registering a name is an error."""

    def deco(fn: AdvantageFn) -> AdvantageFn:
        if name in _ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        _ESTIMATORS[name] = AdvantageEstimator(
            name=name, fn=fn, grouped=grouped, whitens=whitens, per_rollout=per_rollout
        )
        return fn

    return deco


def get_advantage_estimator(name: str) -> AdvantageEstimator:
    if name not in _ESTIMATORS:
        raise ValueError(
            f"unknown advantage estimator {name!r}; known: {', '.join(sorted(_ESTIMATORS))} "
            "(--algo.advantage.estimator; register new ones with register_advantage_estimator)"
        )
    return _ESTIMATORS[name]


def advantage_estimator_names() -> list[str]:
    return sorted(_ESTIMATORS)


# ---- group statistics (per rollout, over its group)


def _group_sum(values: Tensor, group: Tensor) -> Tensor:
    """[R] -> [R]: sum of ``values`` over each element's group."""
    num_groups = int(group.max()) + 1 if group.numel() else 0
    return values.new_zeros(num_groups).index_add_(0, group, values)[group]


def group_size(values: Tensor, group: Tensor) -> Tensor:
    """[R] -> [R]: size of each element's group (as ``values``' dtype)."""
    return _group_sum(torch.ones_like(values), group)


def group_mean(values: Tensor, group: Tensor) -> Tensor:
    """[R] -> [R]: mean of each element's group."""
    return _group_sum(values, group) / group_size(values, group)


def group_std(values: Tensor, group: Tensor) -> Tensor:
    """[R] -> [R]: sample std (n - 1) of each element's group; 0 for singleton groups."""
    sq_sums = _group_sum((values - group_mean(values, group)) ** 2, group)
    n = group_size(values, group)
    return torch.where(n > 1, (sq_sums / (n - 1).clamp(min=1)).sqrt(), torch.zeros_like(values))


def whiten_advantages(advantages: Tensor, action_mask: Tensor, std_norm: bool = True) -> Tensor:
    """(a - mu) / sigma over all action tokens of the batch (token-weighted, population variance); a - mu
    alone when ``std_norm`` is False."""
    mask = as_bool_mask(action_mask).to(advantages.dtype)
    count = mask.sum()
    if count == 0:
        return torch.zeros_like(advantages)
    mean = (advantages * mask).sum() / count
    if not std_norm:
        return (advantages - mean) * mask
    var = (((advantages - mean) ** 2) * mask).sum() / count
    return (advantages - mean) / var.clamp(min=WHITEN_VAR_FLOOR).sqrt() * mask


# ---- indexing


def _index_rollouts(
    group_ids: Sequence[str] | None, rollout_ids: Sequence[str] | None, batch_size: int
) -> tuple[Tensor, Tensor, Tensor]:
    """(sample_rollout [B], rollout_group [R], rollout_first_sample [R]) from the id lists.

    Missing ids fall back to the sample index (each sample its own rollout / group), like Molt's
    legacy path. A rollout id seen under two group ids is corrupt input and raises.
    """
    for label, ids in (("group_ids", group_ids), ("rollout_ids", rollout_ids)):
        if ids is not None and len(ids) != batch_size:
            raise ValueError(f"{label} has {len(ids)} entries for a batch of {batch_size} samples")
    rollout_keys = list(rollout_ids) if rollout_ids is not None else [f"#sample{i}" for i in range(batch_size)]
    rollout_index: dict[str, int] = {}
    rollout_group_key: list[str] = []
    first_sample: list[int] = []
    sample_rollout: list[int] = []
    for i, key in enumerate(rollout_keys):
        group_key = group_ids[i] if group_ids is not None else f"#rollout:{key}"
        if key not in rollout_index:
            rollout_index[key] = len(first_sample)
            first_sample.append(i)
            rollout_group_key.append(group_key)
        elif rollout_group_key[rollout_index[key]] != group_key:
            raise ValueError(
                f"rollout_id {key!r} appears in groups {rollout_group_key[rollout_index[key]]!r} and {group_key!r}; "
                "every segment of a rollout must carry its rollout's group_id"
            )
        sample_rollout.append(rollout_index[key])
    group_index: dict[str, int] = {}
    rollout_group = [group_index.setdefault(g, len(group_index)) for g in rollout_group_key]
    as_long = lambda xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731
    return as_long(sample_rollout), as_long(rollout_group), as_long(first_sample)


def compute_advantages(
    estimator: str,
    rewards: Tensor,
    action_mask: Tensor,
    *,
    group_ids: Sequence[str] | None = None,
    rollout_ids: Sequence[str] | None = None,
    kl: Tensor | None = None,
    values: Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    kl_coef: float = 0.0,
    whiten: bool = True,
    std_norm: bool = True,
    reward_clip: tuple[float, float] | None = (-10.0, 10.0),
) -> tuple[Tensor, Tensor]:
    """``(advantages [B, T], returns [B, T])`` for ``rewards [B]`` on the step-axis ``action_mask``.

    ``kl``: per-token KL (reference or teacher) used by ``reinforce``, ``gae`` and
    ``on_policy_distill`` with coefficient ``kl_coef``; ``values``: critic values (``gae``).
    ``group_ids`` / ``rollout_ids`` (one per sample) drive the grouped estimators; unset, each sample
    is its own group / rollout. ``whiten=False`` is ``--algo.advantage.no_whiten``, ``std_norm=False``
    ``--algo.advantage.no_std_norm`` (subtract the mean only);
    ``reward_clip=None`` disables clipping. Inputs are not modified.
    """
    spec = get_advantage_estimator(estimator)
    if rewards.dim() != 1 or action_mask.dim() != 2 or action_mask.shape[0] != rewards.shape[0]:
        raise ValueError(
            f"need rewards [B] and action_mask [B, T], got {tuple(rewards.shape)} and {tuple(action_mask.shape)}"
        )
    for label, t in (("kl", kl), ("values", values)):
        if t is not None and t.shape != action_mask.shape:
            raise ValueError(f"{label} must have action_mask's shape {tuple(action_mask.shape)}, got {tuple(t.shape)}")
    dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    rewards = rewards.to(dtype)
    if torch.isnan(rewards).any():
        bad = torch.nonzero(torch.isnan(rewards)).flatten().tolist()
        raise ValueError(f"rewards of samples {bad[:8]} are NaN; fix the reward function (NaN poisons the baselines)")
    if reward_clip is not None:
        rewards = rewards.clamp(reward_clip[0], reward_clip[1])
    is_action = as_bool_mask(action_mask)
    mask = is_action.to(dtype)
    off_mask_zero = lambda t: torch.where(is_action, t.to(dtype), 0.0)  # noqa: E731 (garbage off the mask)
    batch_size = rewards.shape[0]
    if spec.grouped or spec.per_rollout:
        index = _index_rollouts(group_ids, rollout_ids, batch_size)
        sample_rollout, rollout_group, first_sample = (t.to(rewards.device) for t in index)
    else:  # every sample is its own rollout and group: multi-segment rollouts are not merged
        sample_rollout = rollout_group = first_sample = torch.arange(batch_size, device=rewards.device)
    batch = AdvantageBatch(
        rewards=rewards,
        action_mask=mask,
        kl=off_mask_zero(kl) if kl is not None else torch.zeros_like(mask),
        values=off_mask_zero(values) if values is not None else None,
        gamma=gamma,
        lam=lam,
        kl_coef=kl_coef,
        rollout_rewards=rewards[first_sample],
        rollout_group=rollout_group,
        sample_rollout=sample_rollout,
    )
    advantages, returns = spec.fn(batch)
    advantages, returns = advantages * mask, returns * mask
    if spec.whitens and whiten:
        advantages = whiten_advantages(advantages, mask, std_norm)
    return advantages, returns
