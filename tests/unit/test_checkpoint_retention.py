"""Molt's checkpoint retention: ``metric.json`` per checkpoint, eviction by --ckpt.max_num / --ckpt.max_mem
(no metric first, then the lowest value, then the oldest), the current and the best checkpoint kept."""

from __future__ import annotations

import asyncio
import json
import logging
import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from molt.algorithms import KLController
from services.trainer import checkpoint
from services.trainer.checkpoint import GB, METRIC_FILE, prune


def _ckpt(root, name: str, metric: float | None = None, *, size: int = 10, metric_file: bool = True) -> None:
    d = root / name
    d.mkdir()
    (d / "extra_state.pt").write_bytes(b"x" * size)
    if metric_file:
        (d / METRIC_FILE).write_text(json.dumps({"metric_key": "eval_gsm8k_pass1", "metric_value": metric}))


def _names(root) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def test_eviction_goes_no_metric_then_lowest_metric_then_oldest(tmp_path):
    _ckpt(tmp_path, "global_step1")  # saved before any evaluation (null)
    _ckpt(tmp_path, "global_step2", metric_file=False)  # no file at all
    _ckpt(tmp_path, "global_step3", 0.5)
    _ckpt(tmp_path, "global_step4", 0.2)
    _ckpt(tmp_path, "global_step5", 0.5)
    _ckpt(tmp_path, "global_step6", 0.9)
    _ckpt(tmp_path, "global_step7", 0.1)  # the one just saved: stays though it is the worst
    expected = [
        ["global_step2", "global_step3", "global_step4", "global_step5", "global_step6", "global_step7"],
        ["global_step3", "global_step4", "global_step5", "global_step6", "global_step7"],
        ["global_step3", "global_step5", "global_step6", "global_step7"],
        ["global_step5", "global_step6", "global_step7"],  # 3 and 5 tie: the older goes
        ["global_step6", "global_step7"],
        ["global_step7"],
    ]
    for max_num, names in zip(range(6, 0, -1), expected):
        prune(tmp_path, max_num, keep="global_step7")
        assert _names(tmp_path) == names


def test_without_metrics_the_newest_are_kept_whatever_the_mtimes(tmp_path):
    """Today's rule, by step (10 is newer than 9), also when directories were written out of order."""
    for name in ("global_step9", "global_step10", "global_step2", "global_step11"):
        _ckpt(tmp_path, name, metric_file=False)
    prune(tmp_path, 2, keep="global_step11")
    assert _names(tmp_path) == ["global_step10", "global_step11"]


def test_max_mem_is_a_budget_in_gb_over_the_kept_and_the_best_checkpoints(tmp_path):
    for step, metric in ((1, 0.3), (2, 0.1), (3, 0.2), (4, 0.4)):
        _ckpt(tmp_path, f"global_step{step}", metric, size=1000)
    _ckpt(tmp_path, "best_global_step4", 0.4, size=1000)
    # 3500 bytes as a fraction of a GB: best, current and one more (~1050 bytes each) fit, two more do not
    prune(tmp_path, 0, keep="global_step4", max_mem=3500 / GB)
    assert _names(tmp_path) == ["best_global_step4", "global_step1", "global_step4"]
    prune(tmp_path, 0, keep="global_step4", max_mem=math.inf)  # inf and max_num <= 0: nothing to bound
    assert len(_names(tmp_path)) == 3


def test_max_num_and_max_mem_both_bind(tmp_path):
    for step in range(1, 6):
        _ckpt(tmp_path, f"global_step{step}", float(step), size=1000)
    prune(tmp_path, 4, keep="global_step5", max_mem=10**6 / GB)  # the count binds
    assert _names(tmp_path) == ["global_step2", "global_step3", "global_step4", "global_step5"]
    prune(tmp_path, 4, keep="global_step5", max_mem=2300 / GB)  # then the budget
    assert _names(tmp_path) == ["global_step4", "global_step5"]


def test_current_and_best_are_never_evicted_and_an_unmet_budget_is_warned_once(tmp_path, caplog):
    _ckpt(tmp_path, "global_step1", 0.9, size=1000)
    _ckpt(tmp_path, "global_step2", None, size=1000)
    _ckpt(tmp_path, "best_global_step1", 0.9, size=1000)
    with caplog.at_level(logging.WARNING, logger="molt.trainer"):
        prune(tmp_path, 1, keep="global_step2", max_mem=500 / GB)
    assert _names(tmp_path) == ["best_global_step1", "global_step2"]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "--ckpt.max_mem" in warnings[0].getMessage()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="molt.trainer"):
        prune(tmp_path, 1, keep="global_step2", max_mem=3000 / GB)  # within budget: silent
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]


def test_a_metric_that_is_not_a_finite_number_counts_as_none(tmp_path):
    _ckpt(tmp_path, "global_step1", 0.0)
    (tmp_path / "global_step2").mkdir()
    (tmp_path / "global_step2" / METRIC_FILE).write_text('{"metric_key": "k", "metric_value": NaN}')
    (tmp_path / "global_step3").mkdir()
    (tmp_path / "global_step3" / METRIC_FILE).write_text("not json")
    _ckpt(tmp_path, "global_step4", -1.0)
    prune(tmp_path, 2, keep="global_step4")
    assert _names(tmp_path) == ["global_step1", "global_step4"]


def test_max_mem_flag_takes_a_fractional_budget_and_refuses_non_positive():
    from molt.config import parse_settings
    from services.trainer.config import TrainerSettings

    s = parse_settings(TrainerSettings, ["--ckpt.max_mem", "0.5"], prog="t")
    s.ckpt.check()
    assert s.ckpt.max_mem == 0.5
    for bad in ("0", "-1", "nan"):
        s = parse_settings(TrainerSettings, ["--ckpt.max_mem", bad], prog="t")
        with pytest.raises(ValueError, match="--ckpt.max_mem must be > 0"):
            s.ckpt.check()


# ---------------------------------------------------------------- real saves (single-process gloo group)


class _Learner:
    def __init__(self) -> None:
        torch.manual_seed(0)
        self.actor = nn.Linear(3, 2)
        self.optim = torch.optim.AdamW(self.actor.parameters(), lr=0.1)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.optim, lambda step: 1.0)
        self.kl_ctl = KLController(0.1, target=0.01, horizon=100)
        self.global_step = 0


def _metric(path) -> dict:
    return json.loads((path / METRIC_FILE).read_text())


def test_a_save_records_its_metric_and_retention_reads_it(tmp_path, one_process_group):
    learner = _Learner()
    for step, value in ((1, None), (2, 0.7), (3, 0.2), (4, 0.5)):
        learner.global_step = step
        key = None if value is None else "eval_gsm8k_pass1"
        saved = checkpoint.save(str(tmp_path), learner, {}, max_num=3, metric_key=key, metric_value=value)
        assert _metric(saved) == {"metric_key": key, "metric_value": value}
    # 1 (no metric) went when 4 came; the best dir gets its metric too and stays out of the count
    learner.global_step = 2
    best = checkpoint.save(str(tmp_path), learner, {}, best=True, metric_key="eval_gsm8k_pass1", metric_value=0.7)
    assert _metric(best)["metric_value"] == 0.7
    learner.global_step = 5
    checkpoint.save(str(tmp_path), learner, {}, max_num=3, metric_key="eval_gsm8k_pass1", metric_value=0.5)
    assert _names(tmp_path) == ["best_global_step2", "global_step2", "global_step4", "global_step5", "latest"]
    assert checkpoint.latest_dir(str(tmp_path)).name == "global_step5"
    assert checkpoint.record_metric(str(tmp_path), "global_step5", "eval_gsm8k_pass1", 0.1)
    assert _metric(tmp_path / "global_step5")["metric_value"] == 0.1
    assert not checkpoint.record_metric(str(tmp_path), "global_step9", "eval_gsm8k_pass1", 0.1)


class _IO:
    def run(self, coro):
        return asyncio.run(coro)


def _trainer(tmp_path, learner, evals: list[dict[str, float]], **ckpt):
    """A Trainer reduced to what _save and _evaluate use, on rank 0 of a one-process group."""
    from molt.config import parse_settings
    from services.trainer.config import TrainerSettings
    from services.trainer.metrics import trainer_metrics
    from services.trainer.model import DistInfo
    from services.trainer.trainer import Trainer

    flags = ["--ckpt.path", str(tmp_path), "--ckpt.save_steps", "1"]
    for k, v in ckpt.items():
        flags += [f"--ckpt.{k}", str(v)]
    t = object.__new__(Trainer)
    t.s = parse_settings(TrainerSettings, flags, prog="t")
    t.info = DistInfo(rank=0, world_size=1, device=torch.device("cpu"), backend="gloo")
    t.metrics = trainer_metrics()
    t.learner = learner
    t.best, t._best_pending, t.last_metric, t.last_saved_step = None, None, (None, None), -1

    async def durable_state(step):
        return {"step": step}

    async def commit():
        return None

    async def run(step, should_stop):
        return evals.pop(0)

    t._io = _IO()
    t._controller = SimpleNamespace(durable_state=durable_state, commit=commit, stop_requested=False)
    t.evaluator = SimpleNamespace(run=run)
    t.steplog = SimpleNamespace(log_eval=lambda step, metrics: None)
    return t


def test_the_trainer_saves_the_latest_eval_metric_and_that_of_its_own_step(tmp_path, one_process_group):
    learner = _Learner()
    t = _trainer(
        tmp_path,
        learner,
        [{"eval_a_pass1": 0.4, "eval_a_pass4": 0.9, "eval_b_pass1": 0.1}, {"eval_a_pass1": 0.6}],
        max_num=2,
    )
    learner.global_step = 1
    t._save()  # before any evaluation
    assert _metric(tmp_path / "global_step1") == {"metric_key": None, "metric_value": None}
    t._evaluate()  # the evaluation of step 1's weights, which the trainer runs after step 1's save
    assert _metric(tmp_path / "global_step1") == {"metric_key": "eval_a_pass1", "metric_value": 0.4}
    learner.global_step = 2
    t._save()  # no evaluation at step 2: it carries the latest one
    assert _metric(tmp_path / "global_step2")["metric_value"] == 0.4
    learner.global_step = 3
    t._save()  # 1 and 2 tie on 0.4: the older goes
    assert _names(tmp_path) == ["global_step2", "global_step3", "latest"]
    t._evaluate()
    assert _metric(tmp_path / "global_step3")["metric_value"] == 0.6
    assert _metric(tmp_path / "global_step2")["metric_value"] == 0.4  # an evaluation of other weights


def test_best_metric_key_none_records_no_metric(tmp_path, one_process_group):
    learner = _Learner()
    t = _trainer(tmp_path, learner, [{"eval_a_pass1": 0.4}], best_metric_key="none")
    learner.global_step = 1
    t._save()
    t._evaluate()
    assert _metric(tmp_path / "global_step1") == {"metric_key": None, "metric_value": None}


def test_a_save_removes_partial_saves_a_killed_process_left(tmp_path, one_process_group):
    """A SIGKILL mid-save leaves .tmp-global_step<N>; the next save of any step removes it."""
    (tmp_path / ".tmp-global_step7" / "model_optim").mkdir(parents=True)
    (tmp_path / ".tmp-best_global_step5").mkdir()
    learner = _Learner()
    learner.global_step = 3
    checkpoint.save(str(tmp_path), learner, {})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step3", "latest"]
