"""Dynamic filtering of prompt groups (DAPO-style; ``--algo.dynamic_filtering_enable``).

A group whose rollouts all succeed or all fail has zero group-relative advantage: it costs a train
step and teaches nothing. The rollout side therefore judges every finished group and refills the
dropped slots with new prompts:

1. one representative per ``rollout_id`` (the segments of a multi-segment rollout count once, first
   seen wins);
2. fewer than ``n_samples_per_prompt`` surviving rollouts -> drop (``incomplete_group``);
3. if every representative has a score: keep iff ``low < mean(score) < high``, an *open* interval
   (``--algo.dynamic_filtering_range``, default 0 1), else drop (``dynamic_filter``). A group with a
   missing score is kept (nothing to judge it by).

``filtering_metrics`` summarises a batch of verdicts as Molt logs it: ``dynamic_filtering_pass_rate`` (kept /
judged, in percent), ``rollout/pre_filter_mean_score`` (mean score over the representatives of every scored
group, incomplete ones too, before filtering), ``rollout/group_all_pass_rate`` /
``rollout/group_all_fail_rate`` (percent of scored groups with mean >= high / mean <= low), and
``rollout/dropped/<reason>`` / ``rollout/dropped/total`` (samples dropped, when any were; the trainer adds
``no_action_tokens``, segments with no action token within ``--data.max_len``, with filtering on or off).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

INCOMPLETE_GROUP = "incomplete_group"
DYNAMIC_FILTER = "dynamic_filter"
NO_ACTION_TOKENS = "no_action_tokens"


@dataclass(frozen=True)
class GroupVerdict:
    keep: bool
    reason: str | None
    """None when kept, else ``incomplete_group`` or ``dynamic_filter`` (the drop-reason metric suffix)."""
    scores: tuple[float, ...] | None
    """One score per rollout (an incomplete group's too), or None if a score was missing."""
    score_range: tuple[float, float]
    samples: int = 0
    """Samples (segments) of the group, which a drop counts in ``rollout/dropped/<reason>``."""

    @property
    def mean_score(self) -> float | None:
        return sum(self.scores) / len(self.scores) if self.scores else None


def filter_group(
    rollout_ids: Sequence[str],
    scores: Sequence[float | None],
    *,
    n_samples_per_prompt: int,
    score_range: Sequence[float] = (0.0, 1.0),
) -> GroupVerdict:
    """Judge one finished group given its samples' rollout ids and scores (one entry per sample)."""
    samples = len(rollout_ids)
    if len(rollout_ids) != len(scores):
        raise ValueError(f"{len(rollout_ids)} rollout ids but {len(scores)} scores")
    low, high = float(score_range[0]), float(score_range[1])
    if not low < high:
        raise ValueError(f"--algo.dynamic_filtering_range needs LOW < HIGH, got {low} {high}")
    representative: dict[str, float | None] = {}
    for rollout_id, score in zip(rollout_ids, scores):
        representative.setdefault(rollout_id, score)
    missing = any(s is None for s in representative.values())
    group_scores = None if missing else tuple(float(s) for s in representative.values() if s is not None)
    if len(representative) < n_samples_per_prompt:
        return GroupVerdict(False, INCOMPLETE_GROUP, group_scores, (low, high), samples)
    if group_scores is None:
        return GroupVerdict(True, None, None, (low, high), samples)
    mean = sum(group_scores) / len(group_scores)
    keep = low < mean < high
    return GroupVerdict(keep, None if keep else DYNAMIC_FILTER, group_scores, (low, high), samples)


def filtering_metrics(verdicts: Sequence[GroupVerdict], no_action_tokens: int = 0) -> dict[str, float]:
    """Rollout-side metrics for a batch of judged groups, plus ``no_action_tokens`` segments dropped one by one
    (nothing judged or dropped -> empty dict)."""
    metrics: dict[str, float] = {}
    if verdicts:
        metrics["dynamic_filtering_pass_rate"] = 100.0 * sum(v.keep for v in verdicts) / len(verdicts)
    # (scores, range) of the groups that have scores (their mean_score is then a float)
    scored = [(v.scores, v.score_range) for v in verdicts if v.scores]
    if scored:
        all_scores = [s for scores, _ in scored for s in scores]
        means = [(sum(scores) / len(scores), lo, hi) for scores, (lo, hi) in scored]
        metrics["rollout/pre_filter_mean_score"] = sum(all_scores) / len(all_scores)
        metrics["rollout/group_all_pass_rate"] = 100.0 * sum(m >= hi for m, _, hi in means) / len(scored)
        metrics["rollout/group_all_fail_rate"] = 100.0 * sum(m <= lo for m, lo, _ in means) / len(scored)
    drops = [(v.reason, v.samples) for v in verdicts if v.reason is not None]
    if no_action_tokens:
        drops.append((NO_ACTION_TOKENS, no_action_tokens))
    for reason, n in drops:
        key = f"rollout/dropped/{reason}"
        metrics[key] = metrics.get(key, 0.0) + n
    if drops:
        metrics["rollout/dropped/total"] = float(sum(n for _, n in drops))
    return metrics


__all__ = [
    "DYNAMIC_FILTER",
    "INCOMPLETE_GROUP",
    "NO_ACTION_TOKENS",
    "GroupVerdict",
    "filter_group",
    "filtering_metrics",
]
