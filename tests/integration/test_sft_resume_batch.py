"""SFT runs on one checkpoint path: a resume under another --train.batch_size continues after the samples the saved
run consumed; --ckpt.load_enable on an empty path says the run starts from step 0, and a run that would save into
another run's checkpoints without it is refused. --eval.dataset naming the training folder without --eval.split
evaluates on the training rows (the split defaults to train, as in Molt): the run says so, and is quiet once the
held-out split is picked."""

from __future__ import annotations

import pytest

from tests.integration.sft_testlib import (
    lines,
    one_error_line,
    reversal_flags,
    reversal_rows,
    run_sft,
    sft_start_up,
    write_jsonl,
)

pytestmark = pytest.mark.timeout(600)

WARNING = "is the training data (--data.dataset, --data.dataset_split): eval_loss is a training loss"


def _flags(model, tmp, batch, *extra):
    return reversal_flags(
        model,
        tmp / "data",
        "--eval.dataset",
        str(tmp / "data"),
        "--train.batch_size",
        str(batch),
        "--train.max_epochs",
        "1",
        "--ckpt.path",
        str(tmp / "state"),
        "--ckpt.disable_final_save",
        "--logger.steps_jsonl",
        str(tmp / "steps.jsonl"),
        *extra,
    )


@pytest.fixture(scope="module")
def runs(tiny_qwen3, tmp_path_factory):
    """(folder, stderr of a run saving step 3 at --train.batch_size 4, stderr of its resume at 8). Every test here
    reads these two runs: each SFT process costs seconds of imports before its first step. The first resumes
    from an empty path and evaluates on the training split, the second on the held-out one."""
    tmp = tmp_path_factory.mktemp("sft_resume")
    (tmp / "data").mkdir()
    write_jsonl(tmp / "data" / "train.jsonl", reversal_rows(48, seed=1))
    write_jsonl(tmp / "data" / "test.jsonl", reversal_rows(4, seed=2))
    saved = ["--train.num_steps", "3", "--ckpt.save_steps", "3", "--ckpt.load_enable"]
    first = run_sft(_flags(tiny_qwen3, tmp, 4, *saved))
    second = run_sft(_flags(tiny_qwen3, tmp, 8, "--ckpt.load_enable", "--eval.split", "test"))
    return tmp, first.stderr, second.stderr


def test_resume_with_a_larger_batch_continues_after_the_consumed_samples(runs):
    tmp, _, resumed = runs
    # 12 samples at batch 4, then batch 8: step 12 // 8 = 1, windows from sample 12 to the epoch's last whole one
    assert "resuming after 12 samples: epoch 0, sample 12 of its order, step 1 at --train.batch_size 8" in resumed
    steps = [x["step"] for x in lines(tmp / "steps.jsonl") if "loss" in x]
    assert steps == [1, 2, 3, 2, 3, 4, 5]


def test_saving_over_another_runs_checkpoints_needs_load_enable(tiny_qwen3, runs, capsys, monkeypatch):
    tmp, first, _ = runs
    state = tmp / "state"
    assert f"--ckpt.load_enable: no checkpoint under --ckpt.path {state}; starting from step 0" in first
    assert sorted(p.name for p in state.glob("global_step*")) == ["global_step3"]
    refused = f"--ckpt.path {state} holds checkpoints of an earlier run (newest global_step3)"
    save = _flags(tiny_qwen3, tmp, 4, "--train.num_steps", "3", "--ckpt.save_steps", "3")
    # The start-up checks refuse it, as they do under --dry-run, before anything loads: main() runs in this
    # process (a process exiting from these checks is test_sft_train's bad-input test).
    for extra in ([], ["--dry-run"]):
        one_error_line(*sft_start_up([*save, *extra], capsys, monkeypatch), refused)
    # resuming it, or a run that saves no checkpoint there, is fine
    assert sft_start_up([*save, "--ckpt.load_enable", "--dry-run"], capsys, monkeypatch)[0] == 0
    assert sft_start_up(_flags(tiny_qwen3, tmp, 4, "--train.num_steps", "1", "--dry-run"), capsys, monkeypatch)[0] == 0


def test_eval_on_the_training_split_is_warned(runs):
    _, first, second = runs
    assert "--eval.dataset: 48 rows, 48 used" in first and WARNING in first
    assert "--eval.dataset: 4 rows, 4 used" in second and WARNING not in second
