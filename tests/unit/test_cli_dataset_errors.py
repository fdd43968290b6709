"""`molt train-rl` / `molt up` check the trainer's dataset before anything starts: a missing
--data.prompt_dataset, a split its folder lacks, or a --data.input_key its rows lack is one line naming the
flag, exit 2, within seconds (the trainer starts last, so it used to surface only once Redis, the pods, the
gateway and the env workers were up, as a traceback). --dry-run refuses the same with the same line. A service
that fails once the stack runs is one line naming it and its log."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROG = "molt (the trainer's flags): error: "


def _molt(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "molt.cli", *args], capture_output=True, text=True, timeout=120, cwd=ROOT
    )


def _error_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "[molt up]" not in proc.stdout  # no run folder announced, no service started
    return lines[0]


@pytest.mark.parametrize("own", [["--dry-run"], ["--no-progress"]])
@pytest.mark.parametrize("case", ["missing path", "missing input key", "missing split"])
def test_a_bad_prompt_dataset_stops_train_rl_in_seconds_naming_the_flag(tmp_path, tiny_qwen3, own, case):
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "1 + 1?", "answer": "2"}\n')
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "train.jsonl").write_text('{"prompt": "1 + 1?", "answer": "2"}\n')
    data, key, split, expected = {
        "missing path": (tmp_path / "nope.jsonl", "prompt", "train", f"{tmp_path / 'nope.jsonl'}: no such file"),
        "missing input key": (
            tmp_path / "prompts.jsonl",
            "question",
            "train",
            f"{tmp_path / 'prompts.jsonl'}: row 0 has no 'question' (--data.input_key); keys: ['answer', 'prompt']",
        ),
        "missing split": (
            tmp_path / "folder",
            "prompt",
            "test",
            f"{tmp_path / 'folder'}: no 'test' split (splits: ['train']); choose one with --data.prompt_split",
        ),
    }[case]
    run_dir = tmp_path / "run"
    agent = str(ROOT / "examples" / "agents" / "math.py")
    flags = ["--actor.model_name_or_path", str(tiny_qwen3), "--train.agent_path", agent]
    flags += ["--data.prompt_dataset", str(data), "--data.input_key", key, "--data.label_key", "answer"]
    flags += ["--data.prompt_split", split]
    started = time.monotonic()
    proc = _molt("train-rl", *own, "--run-dir", str(run_dir), *flags)
    assert time.monotonic() - started < 30, "the stack started before the dataset was checked"
    assert _error_line(proc).startswith(f"{PROG}--data.prompt_dataset {expected}")
    assert not run_dir.exists()


def test_molt_up_checks_a_dataset_set_for_the_trainer_before_starting_anything(tmp_path):
    run_dir = tmp_path / "run"
    started = time.monotonic()
    proc = _molt("up", "--run-dir", str(run_dir), "--no-progress", "--set", "trainer", "data.input_key=question")
    assert time.monotonic() - started < 60
    line = _error_line(proc)
    assert line.startswith(f"{PROG}--data.prompt_dataset {run_dir / 'prompts.jsonl'}: row 0 has no 'question'")
    assert sorted(p.name for p in run_dir.iterdir()) == ["prompts.jsonl"]  # no service log: nothing started


def test_a_service_that_fails_is_one_line_naming_it_and_its_log(monkeypatch, capsys):
    from molt import cli
    from molt.stack import up
    from molt.stack.procs import ServiceFailed

    def fail(_options):
        raise ServiceFailed("trainer exited before it was ready; log /r/trainer.log:\nTraceback\nValueError: x")

    monkeypatch.setattr(up, "run_stack", fail)
    assert cli.main(["up", "--no-progress"]) == 1
    assert capsys.readouterr().err == "molt: error: trainer exited before it was ready; log /r/trainer.log\n"


def test_a_bad_line_found_only_mid_run_is_named_on_molts_line(monkeypatch, capsys):
    """The start-up check reads one row; a malformed line deep in the file ends the trainer with its own one-line
    error in its log, and molt's line carries it: the file and the line, without opening the log."""
    from molt import cli
    from molt.stack import up
    from molt.stack.procs import ServiceFailed

    own = "--data.prompt_dataset /d/p.jsonl:4: not a JSON line (Expecting value)"

    def fail(_options):
        raise ServiceFailed(
            "trainer exited with code 1; log /r/trainer.log:\n"
            "2026-01-01 00:00:00,000 INFO rank0 molt.trainer: actor: 10 of 10 parameters train\n"
            f"python -m services.trainer: error: {own}"
        )

    monkeypatch.setattr(up, "run_stack", fail)
    assert cli.main(["up", "--no-progress"]) == 1
    assert (
        capsys.readouterr().err == f"molt: error: trainer exited with code 1; log /r/trainer.log; its error: {own}\n"
    )
