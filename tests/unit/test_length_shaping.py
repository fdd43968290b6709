"""Molt's length penalties (--reward.overlong_buffer_len / overlong_penalty_factor / stop_properly_penalty_coef):
the rules as Molt states them, each expected value worked out next to it (context 1000 tokens, buffer 200, so the
penalty starts past 800 tokens and is full at 1000)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from molt.algorithms.length_shaping import LengthShaping, shape_rewards, shaping_metrics
from molt.config import parse_settings
from services.trainer.checks import validate_settings
from services.trainer.config import TrainerSettings


def _shape(rewards, lengths, truncated=None, keys=None, **kw):
    shaping = LengthShaping(context_len=1000, **kw)
    truncated = truncated or [False] * len(rewards)
    keys = keys or [str(i) for i in range(len(rewards))]
    shaped, parts = shape_rewards(torch.tensor(rewards), lengths, truncated, keys, shaping)
    return shaped.tolist(), {k: v.tolist() for k, v in parts.items()}


def test_overlong_penalty_grows_linearly_over_the_buffer_and_stops_at_the_factor():
    # 700 is outside the buffer; 900 is 100 of 200 into it: -0.5; 1000 fills it: -1
    shaped, parts = _shape([1.0, 1.0, 1.0], [700, 900, 1000], overlong_buffer_len=200)
    assert shaped == pytest.approx([1.0, 0.5, 0.0]) and parts["overlong_penalty"] == pytest.approx([0, -0.5, -1])
    shaped, _ = _shape([0.0, 0.0], [900, 1000], overlong_buffer_len=200, overlong_penalty_factor=2.0)
    assert shaped == pytest.approx([-1.0, -2.0])


def test_a_rollout_is_as_long_as_its_longest_segment_not_its_segments_together():
    # two windows of a compacted rollout, 700 + 750 tokens: each fitted, no penalty
    shaped, _ = _shape([1.0, 1.0], [700, 750], keys=["a", "a"], overlong_buffer_len=200)
    assert shaped == [1.0, 1.0]
    # the longer window decides, and both segments carry the rollout's reward: 860 -> -60/200
    shaped, parts = _shape([1.0, 1.0], [300, 860], keys=["a", "a"], overlong_buffer_len=200)
    assert shaped == pytest.approx([0.7, 0.7]) and parts["length_penalty"] == pytest.approx([-0.3, -0.3])


@pytest.mark.parametrize("coef,expected", [(0.5, 0.5), (0.0, 0.0), (1.0, 1.0), (-2.0, -2.0)])
def test_stop_properly_scales_or_replaces_a_truncated_rollouts_reward(coef, expected):
    # rollout a: one of its two segments was cut; rollout b was not
    shaped, parts = _shape(
        [1.0, 1.0, 1.0], [10, 10, 10], [False, True, False], ["a", "a", "b"], stop_properly_penalty_coef=coef
    )
    assert shaped == pytest.approx([expected, expected, 1.0])
    assert parts["stop_properly_penalty"] == pytest.approx([expected - 1, expected - 1, 0.0])


def test_overlong_comes_first_then_stop_properly_and_the_parts_add_up():
    # 950 tokens: -150/200 = -0.75 -> 0.25; truncated, x0.5 -> 0.125
    shaped, parts = _shape([1.0], [950], [True], overlong_buffer_len=200, stop_properly_penalty_coef=0.5)
    assert shaped == pytest.approx([0.125])
    assert parts == {"length_penalty": [-0.875], "overlong_penalty": [-0.75], "stop_properly_penalty": [-0.125]}


def test_keys_decide_what_is_one_rollout():
    # the same samples shaped per segment (reinforce, gae): only the long, cut one is penalized
    shaped, _ = _shape(
        [1.0, 1.0], [960, 100], [True, False], ["0", "1"], overlong_buffer_len=200, stop_properly_penalty_coef=-2
    )
    assert shaped == [-2.0, 1.0]


def test_off_by_default_the_rewards_pass_unchanged_in_their_dtype():
    rewards = torch.tensor([1.0, 0.0], dtype=torch.bfloat16)
    shaped, parts = shape_rewards(rewards, [999, 999], [True, True], ["a", "b"], LengthShaping(1000))
    assert shaped is rewards and parts == {}
    shaped, parts = shape_rewards(rewards, [900, 10], [False, False], ["a", "b"], LengthShaping(1000, 200.0))
    assert shaped.dtype == torch.bfloat16 and shaped.tolist() == [0.5, 0.0]


def test_metrics_count_rollouts_not_segments():
    parts = {"length_penalty": [-1.0, -1.0, -1.0, 0.0], "overlong_penalty": [-1.0, 0.0, 0.0, 0.0]}
    parts["stop_properly_penalty"] = [0.0] * 4
    out = shaping_metrics(["a", "a", "a", "b"], parts)
    assert out["rollout/overlong_frac"] == 0.5 and out["length_penalty"] == -0.5
    assert out["overlong_penalty"] == pytest.approx(-1 / 6) and shaping_metrics(["a"], {}) == {}


BAD = [
    (["--reward.overlong_buffer_len", "0"], "overlong_buffer_len must be finite and in (0, --data.max_len 2048)"),
    (["--reward.overlong_buffer_len", "2048"], "overlong_buffer_len must be finite and in"),
    (["--reward.overlong_buffer_len", "nan"], "overlong_buffer_len must be finite and in"),
    (["--reward.overlong_buffer_len", "200", "--reward.overlong_penalty_factor", "-1"], "factor must be finite"),
    (["--reward.overlong_penalty_factor", "inf"], "factor must be finite"),
    (["--reward.stop_properly_penalty_coef", "1.5"], "coef must be finite and <= 1"),
    (["--reward.stop_properly_penalty_coef", "nan"], "coef must be finite and <= 1"),
]


@pytest.mark.parametrize("flags,message", BAD)
def test_bad_values_are_refused_with_the_flag_before_training(flags, message):
    s = parse_settings(
        TrainerSettings, ["--actor.model_name_or_path", "/m", "--train.dispatch", "false", *flags], environ={}
    )
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate_settings(s)


def test_molt_train_rl_dry_run_refuses_a_bad_value_in_one_line(tmp_path):
    (tmp_path / "p.jsonl").write_text('{"prompt": "1+1", "label": "2"}\n')
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")  # the dry run checks what a real run checks first
    (tmp_path / "agent.py").write_text("")
    flags = "--actor.model_name_or_path m --train.agent_path agent.py --data.prompt_dataset p.jsonl "
    flags += "--reward.stop_properly_penalty_coef 2"
    r = subprocess.run(
        [sys.executable, "-m", "molt.cli", "train-rl", "--dry-run", *flags.split()],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert r.returncode == 2 and "--reward.stop_properly_penalty_coef must be finite and <= 1" in r.stderr, r
    assert "Traceback" not in r.stderr


def test_good_values_pass_and_reach_the_shaping():
    s = parse_settings(
        TrainerSettings,
        "--actor.model_name_or_path /m --train.dispatch false --data.max_len 4096 --reward.overlong_buffer_len 512 "
        "--reward.overlong_penalty_factor 0.5 --reward.stop_properly_penalty_coef -0.5".split(),
        environ={},
    )
    validate_settings(s)
    assert LengthShaping.of(s.reward, s.data.max_len) == LengthShaping(4096, 512.0, 0.5, -0.5)
