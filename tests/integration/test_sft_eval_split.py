"""--eval.dataset naming the training folder without --eval.split evaluates on the training rows (the split
defaults to train, as in Molt): the run says so, and is quiet once the held-out split is picked."""

from __future__ import annotations

import pytest

from tests.integration.sft_testlib import reversal_rows, run_sft, write_jsonl

pytestmark = pytest.mark.timeout(600)


def test_eval_on_the_training_split_is_warned(tiny_qwen3, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    write_jsonl(data / "train.jsonl", reversal_rows(8, seed=1))
    write_jsonl(data / "test.jsonl", reversal_rows(4, seed=2))
    flags = ["--model.model_name_or_path", str(tiny_qwen3), "--data.dataset", str(data), "--eval.dataset", str(data)]
    flags += ["--data.input_key", "prompt", "--data.output_key", "response", "--data.max_len", "64"]
    flags += ["--train.batch_size", "8", "--train.micro_batch_size", "8", "--train.num_steps", "1"]
    flags += ["--model.gradient_checkpoint", "none", "--ckpt.disable_final_save", "--ckpt.path", str(tmp_path / "s")]
    warning = "is the training data (--data.dataset, --data.dataset_split): eval_loss is a training loss"
    proc = run_sft(flags)
    assert "--eval.dataset: 8 rows, 8 used" in proc.stderr and warning in proc.stderr
    proc = run_sft([*flags, "--eval.split", "test"])
    assert "--eval.dataset: 4 rows, 4 used" in proc.stderr and warning not in proc.stderr
