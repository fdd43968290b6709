"""Dynamic filtering of prompt groups."""

from __future__ import annotations

import pytest

from molt.algorithms import filter_group, filtering_metrics


def _judge(scores, rollout_ids=None, n=4, score_range=(0.0, 1.0)):
    rollout_ids = rollout_ids or [f"r{i}" for i in range(len(scores))]
    return filter_group(rollout_ids, scores, n_samples_per_prompt=n, score_range=score_range)


def test_open_interval():
    assert not _judge([1, 1, 1, 1]).keep  # mean 1 = high: all pass, nothing to learn
    assert _judge([1, 1, 1, 1]).reason == "dynamic_filter"
    assert not _judge([0, 0, 0, 0]).keep  # mean 0 = low
    kept = _judge([1, 0, 0, 0])
    assert kept.keep and kept.reason is None and kept.mean_score == 0.25
    assert _judge([1, 0, 0, 0], score_range=(0.2, 0.8)).keep  # 0.2 < 0.25 < 0.8
    assert not _judge([1, 0, 0, 0, 0], n=5, score_range=(0.2, 0.8)).keep  # mean 0.2 is not inside (0.2, 0.8)


def test_incomplete_group_and_segments_count_once():
    assert _judge([1, 0, 0], n=4).reason == "incomplete_group"
    # five samples but only three rollouts (r0 has three segments): incomplete
    verdict = _judge([1, 1, 1, 0, 0], rollout_ids=["r0", "r0", "r0", "r1", "r2"], n=4)
    assert not verdict.keep and verdict.reason == "incomplete_group"
    # four rollouts, r0 in two segments: one representative each, first seen wins (score 1 for r0)
    verdict = _judge([1, 0, 1, 1, 1], rollout_ids=["r0", "r0", "r1", "r2", "r3"], n=4)
    assert verdict.scores == (1.0, 1.0, 1.0, 1.0) and verdict.reason == "dynamic_filter"


def test_missing_score_keeps_the_group():
    verdict = _judge([1, None, 1, 1])
    assert verdict.keep and verdict.scores is None


def test_metrics():
    verdicts = [_judge([1, 0, 0, 0]), _judge([1, 1, 1, 1]), _judge([0, 0, 0, 0]), _judge([1, 0], n=4)]
    metrics = filtering_metrics(verdicts)
    assert metrics["dynamic_filtering_pass_rate"] == pytest.approx(25.0)  # 1 kept of 4 judged
    # as Molt: every scored group counts before filtering, the incomplete one too (14 rollouts, 4 groups)
    assert metrics["rollout/pre_filter_mean_score"] == pytest.approx(6 / 14)
    assert metrics["rollout/group_all_pass_rate"] == pytest.approx(25.0)  # percent, as Molt logs them
    assert metrics["rollout/group_all_fail_rate"] == pytest.approx(25.0)
    assert metrics["rollout/dropped/dynamic_filter"] == 8 and metrics["rollout/dropped/incomplete_group"] == 2
    assert metrics["rollout/dropped/total"] == 10
    assert filtering_metrics([]) == {}
    # segments left without an action token are Molt's per-response drop reason, filtering on or off
    with_idle = filtering_metrics(verdicts, no_action_tokens=3)
    assert with_idle["rollout/dropped/no_action_tokens"] == 3 and with_idle["rollout/dropped/total"] == 13
    assert filtering_metrics([], no_action_tokens=2) == {
        "rollout/dropped/no_action_tokens": 2.0,
        "rollout/dropped/total": 2.0,
    }


def test_bad_input():
    with pytest.raises(ValueError, match="--algo.dynamic_filtering_range needs LOW < HIGH"):
        _judge([1, 0, 0, 0], score_range=(1.0, 1.0))
    with pytest.raises(ValueError, match="3 rollout ids but 2 scores"):
        filter_group(["a", "b", "c"], [1, 0], n_samples_per_prompt=2)
