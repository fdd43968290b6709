"""Molt's final save after a run that trained no step: the RL trainer still writes the HF model directory, of the
weights it started from (a fresh run's base model, a resumed run's checkpoint), and the log says which and why.
The trainer is reduced to what its end of run uses, on rank 0 of a one-process group, with a real tiny model."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from molt.config import parse_settings
from services.trainer.config import TrainerSettings
from services.trainer.model import DistInfo
from services.trainer.trainer import Trainer


def _trainer(tmp_path, model_dir, step: int, first_step: int, *flags: str) -> Trainer:
    from transformers import AutoModelForCausalLM

    t = object.__new__(Trainer)
    t.s = parse_settings(
        TrainerSettings,
        [
            *("--actor.model_name_or_path", str(model_dir), "--ckpt.path", str(tmp_path / "ckpt" / "state")),
            *("--ckpt.output_dir", str(tmp_path / "out"), *flags),
        ],
        prog="t",
    )
    t.info = DistInfo(rank=0, world_size=1, device=torch.device("cpu"), backend="gloo")
    actor = AutoModelForCausalLM.from_pretrained(model_dir)
    t.learner = SimpleNamespace(actor=actor, hf_source=str(model_dir), global_step=step)  # type: ignore[assignment]
    t.first_step, t.last_saved_step = first_step, step
    t._controller = SimpleNamespace(uncommitted=[], version=step, stop_requested=False)  # type: ignore[assignment]
    return t


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_a_fresh_run_that_trained_no_step_exports_the_base_model(tiny_qwen3, tmp_path, caplog, one_process_group):
    t = _trainer(tmp_path, tiny_qwen3, step=0, first_step=0)
    with caplog.at_level(logging.INFO, logger="molt.trainer"):
        t._finish("no more rollouts to train")
    base = load_file(str(tiny_qwen3 / "model.safetensors"))
    out = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert out.keys() == base.keys() and all(torch.equal(out[k], base[k]) for k in base)
    assert (tmp_path / "out" / "config.json").exists() and (tmp_path / "out" / "tokenizer_config.json").exists()
    assert any(
        "no optimizer step in this run (no more rollouts to train)" in m and f"base model {tiny_qwen3}" in m
        for m in _warnings(caplog)
    ), _warnings(caplog)


def test_a_resumed_run_past_num_steps_exports_the_checkpoints_weights(tiny_qwen3, tmp_path, caplog, one_process_group):
    t = _trainer(tmp_path, tiny_qwen3, 3, 3, "--train.num_steps", "3")
    with torch.no_grad():
        t.learner.actor.model.norm.weight.add_(1.0)  # the resumed checkpoint's weights, not the base model's
    plan = Trainer._plan(t)  # the run stops before its first step, and says why
    assert plan == {"stop": True, "why": "--train.num_steps 3 reached"}
    with caplog.at_level(logging.INFO, logger="molt.trainer"):
        t._finish(plan["why"])
    out = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert torch.equal(out["model.norm.weight"], t.learner.actor.model.norm.weight.detach())
    assert any(
        "(--train.num_steps 3 reached)" in m and "resumed checkpoint's weights (step 3)" in m
        for m in _warnings(caplog)
    ), _warnings(caplog)


@pytest.mark.parametrize("flags", [(), ("--ckpt.disable_final_save",)])
def test_a_run_that_trained_exports_quietly_unless_disabled(tiny_qwen3, tmp_path, caplog, one_process_group, flags):
    t = _trainer(tmp_path, tiny_qwen3, 5, 3, *flags)
    with caplog.at_level(logging.INFO, logger="molt.trainer"):
        t._finish("no more rollouts to train")
    assert (tmp_path / "out").exists() is not bool(flags)
    assert not _warnings(caplog)
