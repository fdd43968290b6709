"""SFT's command line on errors: what the flags cause is one line naming the flag with status 2, wherever it is
found: by the start-up checks, when the loggers open, or once the data loads."""

from __future__ import annotations

import pytest

from tests.integration.sft_testlib import (
    one_error_line,
    reversal_flags,
    reversal_rows,
    run_sft,
    sft_start_up,
    write_jsonl,
)

pytestmark = pytest.mark.timeout(600)


def _flags(model, tmp, *extra):
    data = write_jsonl(tmp / "train.jsonl", reversal_rows(16, seed=1))
    state = ["--ckpt.path", str(tmp / "state"), "--ckpt.output_dir", str(tmp / "hf")]
    return reversal_flags(model, data, "--train.batch_size", "4", *state, *extra)


def test_flag_errors_found_after_the_data_loads_exit_2(tiny_qwen3, tmp_path):
    proc = run_sft(_flags(tiny_qwen3, tmp_path, "--train.batch_size", "32"), check=False)
    one_error_line(proc.returncode, proc.stderr, "16 usable samples are fewer than --train.batch_size 32")
    proc = run_sft(_flags(tiny_qwen3, tmp_path, "--data.max_len", "3"), check=False)
    one_error_line(proc.returncode, proc.stderr, "no usable row (raise --data.max_len (3)")


def test_a_folder_where_a_file_is_wanted_is_a_flag_error(tiny_qwen3, tmp_path, capsys, monkeypatch):
    # The steps file opens in main() after the start-up checks, so that exit is a real process's. The checks
    # themselves exit before anything loads, as --dry-run shows: those run in this process (sft_start_up).
    proc = run_sft(_flags(tiny_qwen3, tmp_path, "--logger.steps_jsonl", str(tmp_path)), check=False)
    one_error_line(proc.returncode, proc.stderr, f"--logger.steps_jsonl {tmp_path}: cannot open it")
    flags = _flags(tiny_qwen3, tmp_path, "--data.tokenizer_chat_template", str(tmp_path), "--dry-run")
    one_error_line(
        *sft_start_up(flags, capsys, monkeypatch), f"--data.tokenizer_chat_template {tmp_path}: a directory"
    )
    afile = tmp_path / "afile"
    afile.write_text("")
    for flag in ("--ckpt.path", "--ckpt.output_dir", "--logger.tensorboard_dir"):
        flags = [*_flags(tiny_qwen3, tmp_path, "--dry-run"), flag, str(afile)]
        one_error_line(*sft_start_up(flags, capsys, monkeypatch), f"{flag} {afile}: a file, not a directory")
