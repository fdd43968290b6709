"""SFT's command line on errors: what the flags cause is one line naming the flag with status 2, wherever it is
found; a run that would save into another run's checkpoints without --ckpt.load_enable is refused."""

from __future__ import annotations

import pytest

from tests.integration.sft_testlib import reversal_flags, reversal_rows, run_sft, write_jsonl

pytestmark = pytest.mark.timeout(600)


def _flags(model, tmp, *extra):
    data = write_jsonl(tmp / "train.jsonl", reversal_rows(16, seed=1))
    state = ["--ckpt.path", str(tmp / "state"), "--ckpt.output_dir", str(tmp / "hf")]
    return reversal_flags(model, data, "--train.batch_size", "4", *state, *extra)


def _one_error_line(proc, text: str) -> None:
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [x for x in proc.stderr.splitlines() if ": error: " in x]
    assert len(errors) == 1 and text in errors[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr


def test_flag_errors_found_after_the_data_loads_exit_2(tiny_qwen3, tmp_path):
    proc = run_sft(_flags(tiny_qwen3, tmp_path, "--train.batch_size", "32"), check=False)
    _one_error_line(proc, "16 usable samples are fewer than --train.batch_size 32")
    proc = run_sft(_flags(tiny_qwen3, tmp_path, "--data.max_len", "3"), check=False)
    _one_error_line(proc, "no usable row (raise --data.max_len (3)")


def test_saving_over_another_runs_checkpoints_needs_load_enable(tiny_qwen3, tmp_path):
    save = ["--train.num_steps", "1", "--ckpt.save_steps", "1", "--ckpt.disable_final_save"]
    proc = run_sft(_flags(tiny_qwen3, tmp_path, *save, "--ckpt.load_enable"))
    assert f"--ckpt.load_enable: no checkpoint under --ckpt.path {tmp_path / 'state'}; starting from step 0" in (
        proc.stderr
    )
    assert (tmp_path / "state" / "global_step1").is_dir()
    for extra in (["--dry-run"], []):
        proc = run_sft(_flags(tiny_qwen3, tmp_path, *save, *extra), check=False)
        _one_error_line(
            proc, f"--ckpt.path {tmp_path / 'state'} holds checkpoints of an earlier run (newest global_step1)"
        )
    # resuming it, or a run that saves no checkpoint there, is fine
    assert run_sft(_flags(tiny_qwen3, tmp_path, *save, "--ckpt.load_enable", "--dry-run")).returncode == 0
    assert run_sft(_flags(tiny_qwen3, tmp_path, "--train.num_steps", "1", "--dry-run")).returncode == 0


def test_a_folder_where_a_file_is_wanted_is_a_flag_error(tiny_qwen3, tmp_path):
    proc = run_sft(
        _flags(tiny_qwen3, tmp_path, "--data.tokenizer_chat_template", str(tmp_path), "--dry-run"), check=False
    )
    _one_error_line(proc, f"--data.tokenizer_chat_template {tmp_path}: a directory")
    proc = run_sft(_flags(tiny_qwen3, tmp_path, "--logger.steps_jsonl", str(tmp_path)), check=False)
    _one_error_line(proc, f"--logger.steps_jsonl {tmp_path}: cannot open it")
    afile = tmp_path / "afile"
    afile.write_text("")
    for flag in ("--ckpt.path", "--ckpt.output_dir", "--logger.tensorboard_dir"):
        proc = run_sft([*_flags(tiny_qwen3, tmp_path, "--dry-run"), flag, str(afile)], check=False)
        _one_error_line(proc, f"{flag} {afile}: a file, not a directory")
