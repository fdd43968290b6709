"""Every metrics file the trainers write is strict JSON: a NaN or infinite metric (``mismatch_kl_fresh`` of a step
with no fresh tokens) is written as null, which jq, JavaScript and Go read, never as Python's bare ``NaN``; and
the readers in this repository take the null as a missing value."""

from __future__ import annotations

import json
import math

import pytest

from molt import strict_json

NAN, INF = float("nan"), float("inf")


def strict(text: str):
    """``json.loads`` as a strict parser: NaN, Infinity and -Infinity are errors."""

    def refuse(word: str):
        raise ValueError(f"not JSON: {word}")

    return json.loads(text, parse_constant=refuse)


def strict_lines(path) -> list[dict]:
    return [strict(line) for line in path.read_text().splitlines()]


def test_non_finite_floats_become_null_at_any_depth():
    import numpy as np

    value = {"a": NAN, "b": [1.0, -INF, {"c": INF}], "d": (np.float64("nan"), 2), "e": True, "f": "NaN", "g": 3}
    assert strict(strict_json.dumps(value)) == {
        "a": None,
        "b": [1.0, None, {"c": None}],
        "d": [None, 2],
        "e": True,
        "f": "NaN",
        "g": 3,
    }


def test_a_nan_the_sanitiser_cannot_see_fails_loudly():
    with pytest.raises(ValueError):
        strict_json.dumps({NAN: 1.0})  # a float key: json would write "NaN" as the key without allow_nan=False


def test_rl_steps_and_eval_files_are_strict_json(tmp_path):
    from services.trainer.config import LoggerConfig
    from services.trainer.steplog import StepLog

    cfg = LoggerConfig(steps_jsonl=str(tmp_path / "steps.jsonl"), eval_jsonl=str(tmp_path / "eval.jsonl"))
    log = StepLog(cfg)
    log.log(1, {"step": 1, "mismatch_kl": 0.1, "mismatch_kl_fresh": NAN, "mismatch_kl_by_pod": {"http://p": INF}})
    log.log_eval(1, {"eval_a_pass1": NAN, "eval_a_pass4": 0.5})
    log.close()
    assert strict_lines(tmp_path / "steps.jsonl") == [
        {"step": 1, "mismatch_kl": 0.1, "mismatch_kl_fresh": None, "mismatch_kl_by_pod": {"http://p": None}}
    ]
    assert strict_lines(tmp_path / "eval.jsonl") == [{"step": 1, "eval_a_pass1": None, "eval_a_pass4": 0.5}]


def test_sft_steps_file_is_strict_json(tmp_path):
    from molt.config import parse_settings
    from services.trainer.sft import Sinks
    from services.trainer.sft_config import SftSettings

    flags = ["--model.model_name_or_path", "m", "--data.dataset", "d.jsonl"]
    s = parse_settings(SftSettings, [*flags, "--logger.steps_jsonl", str(tmp_path / "steps.jsonl")], prog="t")
    sinks = Sinks(s, on=True)
    sinks.write("train", 1, {"loss": NAN, "grad_norm": INF, "lr": 1e-3})
    sinks.write("eval", 1, {"eval_loss": 2.0})
    sinks.close()
    assert strict_lines(tmp_path / "steps.jsonl") == [
        {"step": 1, "loss": None, "grad_norm": None, "lr": 1e-3},
        {"step": 1, "eval_loss": 2.0},
    ]


def test_a_checkpoints_nan_metric_is_written_as_null_and_read_as_none(tmp_path):
    from services.trainer import checkpoint

    (tmp_path / "global_step1").mkdir()
    (tmp_path / "global_step1" / "extra_state.pt").write_bytes(b"")
    assert checkpoint.record_metric(str(tmp_path), "global_step1", "eval_a_pass1", NAN)
    assert strict((tmp_path / "global_step1" / checkpoint.METRIC_FILE).read_text()) == {
        "metric_key": "eval_a_pass1",
        "metric_value": None,
    }
    assert checkpoint.read_metric(tmp_path / "global_step1") is None


def test_molt_up_reads_null_metrics_and_writes_a_strict_summary(tmp_path, capsys):
    from molt.stack.report import Progress, finish_report

    steps = tmp_path / "steps.jsonl"
    rows = [
        {"step": 1, "reward_mean": None, "mismatch_kl": None, "mismatch_kl_fresh": None, "samples": 4},
        {"step": 2, "reward_mean": None, "mismatch_kl": 0.25, "mismatch_kl_fresh": None, "samples": 4},
    ]
    steps.write_text("".join(strict_json.dumps(r) + "\n" for r in rows))
    progress = Progress(steps, total_steps=2)
    progress.poll()
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and all("reward -" in x and "(fresh -)" in x for x in lines)
    summary = finish_report(tmp_path, progress, {}, 1.0, "tiny")
    assert math.isnan(summary["reward_first_10pct"])  # no reward logged: no mean
    assert summary["mismatch_kl_max"] == 0.25 and summary["mismatch_kl_fresh_max"] is None
    written = strict((tmp_path / "summary.json").read_text())
    assert written["reward_first_10pct"] is None and written["mismatch_kl_max"] == 0.25
