"""`molt up` refuses bad numbers and an unusable run folder with one line naming the flag, before it builds a
model or starts a process (a 0 used to read as "the recipe's default", and a run folder it could not create
ended in a traceback)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _molt(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "molt.cli", *args], capture_output=True, text=True, timeout=120, cwd=ROOT
    )


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["--pods", "0"], "molt up: error: argument --pods: must be at least 1, got 0"),
        (["--steps", "0"], "molt up: error: argument --steps: must be at least 1, got 0"),
        (["--steps", "two"], "molt up: error: argument --steps: 'two' is not a whole number"),
        (["--async-queue-size", "-1"], "molt up: error: argument --async-queue-size: must be at least 1, got -1"),
    ],
)
def test_a_bad_number_is_one_line_naming_the_flag(args, line):
    proc = _molt("up", *args)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == line


@pytest.mark.parametrize("command", ["up", "train-rl"])
def test_a_run_folder_that_cannot_be_created_is_one_line(tmp_path, command, tiny_qwen3):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    run_dir = blocker / "run"
    agent = str(ROOT / "examples" / "agents" / "math.py")
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "1 + 1?", "answer": "2"}\n')
    flags = ["--actor.model_name_or_path", str(tiny_qwen3), "--train.agent_path", agent, "--data.prompt_dataset"]
    flags += [str(data), "--data.input_key", "prompt", "--data.label_key", "answer"]
    flags = flags if command == "train-rl" else []
    proc = _molt(command, "--run-dir", str(run_dir), "--no-progress", *flags)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(f"molt: error: --run-dir {run_dir}: cannot create it (")
