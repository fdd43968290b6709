"""--logger.*: a step's metrics reach the JSONL file, TensorBoard event files and an offline W&B run under
Molt's names (train/<key>), with the mean of each Result.info key."""

import json
from types import SimpleNamespace

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from services.trainer.config import LoggerConfig
from services.trainer.steplog import StepLog, info_means, rollout_stats


def test_info_means_average_each_key_over_the_trajectories_that_carry_it():
    trajs = [
        SimpleNamespace(info={"math_exact": 1.0, "turns": 2.0}),
        SimpleNamespace(info={"math_exact": 0.0}),
        SimpleNamespace(info={}),
    ]
    assert info_means(trajs) == {"math_exact": 0.5, "turns": 2.0}  # (1 + 0) / 2; 2 / 1


def test_rollout_stats_count_each_rollout_once_and_pass1_per_prompt_group():
    import numpy as np

    from molt.schema import Segment, Trajectory

    def traj(tid, group, reward, spans_per_segment, status="completed"):
        segs = [
            Segment(
                np.arange(20),
                spans,
                np.zeros(sum(e - s for s, e in spans)),
                np.zeros(sum(e - s for s, e in spans), int),
            )
            for spans in spans_per_segment
        ]
        return Trajectory(tid, group, 0, segs, reward, status=status)

    # group a: a 3-segment failure and a one-segment success; group b: one success, truncated
    trajs = [
        traj("t1", "a", 0.0, [[[2, 4]], [[3, 5]], [[1, 7]]]),
        traj("t2", "a", 1.0, [[[2, 6]]]),
        traj("t3", "b", 1.0, [[[2, 12]]], status="truncated"),
    ]
    stats = rollout_stats(trajs)
    assert stats["rollout/reward_mean"] == 2 / 3  # per rollout, not per segment (which would be 2 / 5)
    assert stats["rollout/pass1"] == (0.5 + 1.0) / 2  # the mean of the groups' means
    assert stats["rollout/reward_std"] == pytest.approx(np.std([0.0, 1.0, 1.0], ddof=1))  # the sample std
    assert (stats["rollout/num_rollouts"], stats["rollout/num_prompt_groups"], stats["rollout/num_samples"]) == (
        3,
        2,
        5,
    )
    assert stats["rollout/response_length_mean"] == (2 + 2 + 6 + 4 + 10) / 5
    assert stats["rollout/truncated_rate"] == 1 / 5


def test_steps_reach_jsonl_tensorboard_and_offline_wandb(tmp_path):
    cfg = LoggerConfig(
        steps_jsonl=str(tmp_path / "not-made-yet" / "steps.jsonl"),  # its folder is made at start-up
        eval_jsonl=str(tmp_path / "evals" / "eval.jsonl"),
        tensorboard_dir=str(tmp_path / "tb"),
        logging_steps=2,
        wandb={"mode": "offline", "dir": str(tmp_path), "run_name": "run1"},
    )
    log = StepLog(cfg)
    assert (tmp_path / "evals").is_dir()
    for step in (1, 2):
        log.log(
            step,
            {
                "step": step,
                "policy_loss": 0.5 * step,
                "math_exact": 1.0,
                "trajectory_ids": ["t"],
                "mismatch_kl_by_pod": {},
            },
        )
    log.close()
    lines = [json.loads(x) for x in (tmp_path / "not-made-yet" / "steps.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2]  # the file gets every step
    acc = EventAccumulator(str(tmp_path / "tb" / "run1"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/policy_loss")] == [(2, 1.0)]  # every 2nd step
    assert [e.value for e in acc.Scalars("train/math_exact")] == [1.0]
    assert list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))


def test_eval_metrics_use_molts_names_per_datasource():
    from services.trainer.evaluate import eval_metrics

    def ok(reward, truncated=False, length=10):
        return {"status": "ok", "reward": reward, "truncated": truncated, "response_tokens": length}

    outcomes = [
        ("math", 0, ok(1.0)),
        ("math", 0, ok(0.0)),
        ("math", 1, ok(0.0)),
        ("math", 1, ok(0.0, True, 30)),
        ("geo", 2, ok(1.0, length=5)),
        ("geo", 2, {"status": "failed"}),
    ]
    m = eval_metrics(outcomes, n=2)
    assert m["eval_math_pass1"] == 0.25  # prompt means 0.5 and 0.0
    assert m["eval_math_pass2"] == 0.5  # prompt bests 1.0 and 0.0
    assert m["eval_math_truncated_rate"] == 0.25 and m["eval_geo_pass1"] == m["eval_geo_pass2"] == 1.0
    assert (m["eval_num_samples"], m["eval_failed"], m["eval_truncated_rate"]) == (5.0, 1.0, 0.2)
    assert (m["eval_math_response_length_mean"], m["eval_geo_response_length_mean"]) == (15.0, 5.0)
    assert m["eval_response_length_mean"] == 13.0  # over the 5 samples that ran
