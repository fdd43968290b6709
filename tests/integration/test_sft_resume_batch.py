"""A resume under another --train.batch_size continues after the samples the saved run consumed."""

from __future__ import annotations

import pytest

from tests.integration.sft_testlib import lines, reversal_flags, reversal_rows, run_sft, write_jsonl

pytestmark = pytest.mark.timeout(600)


def _flags(model, tmp, batch, *extra):
    return reversal_flags(
        model,
        tmp / "train.jsonl",
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


def test_resume_with_a_larger_batch_continues_after_the_consumed_samples(tiny_qwen3, tmp_path):
    write_jsonl(tmp_path / "train.jsonl", reversal_rows(48, seed=1))
    run_sft(_flags(tiny_qwen3, tmp_path, 4, "--train.num_steps", "3", "--ckpt.save_steps", "3"))
    proc = run_sft(_flags(tiny_qwen3, tmp_path, 8, "--ckpt.load_enable"))
    # 12 samples at batch 4, then batch 8: step 12 // 8 = 1, windows from sample 12 to the epoch's last whole one
    assert "resuming after 12 samples: epoch 0, sample 12 of its order, step 1 at --train.batch_size 8" in proc.stderr
    steps = [x["step"] for x in lines(tmp_path / "steps.jsonl")]
    assert steps == [1, 2, 3, 2, 3, 4, 5]
