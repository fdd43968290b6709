"""Each line SFT writes to ``--logger.steps_jsonl`` carries step, epoch, loss, grad_norm, lr, tokens,
response_tokens, seconds and tokens_per_s, as strict JSON (docs/sft.md, "Logs").

Only the training loop of ``services.trainer.sft`` writes the line (its timing fields are added there, after the
learner's step), so this runs the SFT CLI for one step of a tiny model on four rows.
"""

from __future__ import annotations

import json
import math

from tests.integration.sft_testlib import lines, reversal_flags, reversal_rows, run_sft, write_jsonl

DOCUMENTED = {"step", "epoch", "loss", "grad_norm", "lr", "tokens", "response_tokens", "seconds", "tokens_per_s"}


def test_a_steps_jsonl_line_holds_the_documented_keys(tiny_qwen3, tmp_path):
    # One step is enough: the line's keys do not depend on how far the run got, and a run of one step of two rows
    # keeps this well inside a unit test's time.
    steps = tmp_path / "steps.jsonl"
    data = write_jsonl(tmp_path / "d.jsonl", reversal_rows(4, seed=0))
    flags = reversal_flags(tiny_qwen3, data, "--data.max_len", "32", "--train.batch_size", "2")
    flags += ["--train.max_epochs", "1", "--train.num_steps", "1", "--logger.logging_steps", "1"]
    flags += ["--logger.steps_jsonl", str(steps), "--ckpt.path", str(tmp_path / "state")]
    flags += ["--ckpt.output_dir", str(tmp_path / "hf"), "--ckpt.disable_final_save"]
    run_sft(flags, timeout=120)
    [line] = lines(steps)
    assert DOCUMENTED <= set(line), sorted(DOCUMENTED - set(line))
    assert line["step"] == 1 and line["epoch"] == 0
    assert line["response_tokens"] <= line["tokens"] and line["seconds"] > 0
    assert math.isclose(line["tokens_per_s"], line["tokens"] / line["seconds"], rel_tol=1e-6)
    json.loads(steps.read_text().splitlines()[0], parse_constant=_refuse)  # strict JSON: no NaN/Infinity


def _refuse(constant: str):
    raise AssertionError(f"{constant} in a steps.jsonl line: not strict JSON")
