"""`molt up --resume RUN_DIR` refuses, in one line naming --resume and before anything starts, what it cannot
continue: a folder that is no run, a run without a checkpoint, one whose model is gone, one already at its steps,
and flags that would change how the run was started. (The resume itself: tests/e2e/test_stack_resume.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from molt import cli
from molt.stack.up import PLAN_FILE, StackPlan, save_plan


def _run(tmp_path: Path, model: Path, steps: int = 5, saved: int | None = None) -> Path:
    """A run folder as `molt up` leaves it: its plan, and a checkpoint at step ``saved`` if given."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    trainer = ["--ckpt.path", str(run_dir / "ckpt"), "--actor.adam.lr", "1e-3"]
    plan = StackPlan(name="tiny", model=model, agents={"tiny": Path("agent.py")}, agent="tiny", trainer=trainer)
    plan.steps = steps
    save_plan(plan, run_dir)
    if saved is not None:
        step_dir = run_dir / "ckpt" / f"global_step{saved}"
        step_dir.mkdir(parents=True)
        (step_dir / "extra_state.pt").write_bytes(b"")
    return run_dir


def _error(capsys, *argv: str) -> list[str]:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["up", "--no-progress", *argv])
    assert exit_.value.code == 2
    return capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize(
    "flags", [["--recipe", "tiny"], ["--run-dir", "x"], ["--pods", "2"], ["--sync"], ["--async-queue-size", "3"]]
)
def test_flags_that_would_change_the_run_are_refused(tmp_path, capsys, flags):
    lines = _error(capsys, "--resume", str(tmp_path), *flags)
    assert lines[-1] == (
        f"molt up: error: argument --resume: the run continues as it was started, so {flags[0]} cannot change "
        "(--steps, --set and --redis-url can)"
    )


def test_a_folder_that_holds_no_run_is_refused(tmp_path, capsys):
    assert _error(capsys, "--resume", str(tmp_path / "nope")) == [
        f"molt: error: --resume {tmp_path / 'nope'}: no such folder (a run folder that molt up or molt train-rl "
        "printed)"
    ]
    assert _error(capsys, "--resume", str(tmp_path)) == [
        f"molt: error: --resume {tmp_path}: no {PLAN_FILE} there (not a run folder of molt up or molt train-rl)"
    ]


def test_a_run_without_a_checkpoint_is_refused(tmp_path, capsys, tiny_qwen3):
    run_dir = _run(tmp_path, tiny_qwen3)
    assert _error(capsys, "--resume", str(run_dir)) == [
        f"molt: error: --resume {run_dir}: no checkpoint in {run_dir / 'ckpt'} to resume from (the trainer writes "
        "one every --ckpt.save_steps steps and when it stops; a run started with --set trainer ckpt.save_steps=-1 "
        "keeps none)"
    ]


def test_a_run_whose_model_is_gone_is_refused(tmp_path, capsys):
    run_dir = _run(tmp_path, tmp_path / "gone", saved=2)
    assert _error(capsys, "--resume", str(run_dir)) == [
        f"molt: error: --resume {run_dir}: the run's model {tmp_path / 'gone'} is gone (no config.json there)"
    ]


def test_a_run_at_its_steps_needs_more_steps(tmp_path, capsys, tiny_qwen3):
    run_dir = _run(tmp_path, tiny_qwen3, steps=5, saved=5)
    assert _error(capsys, "--resume", str(run_dir)) == [
        f"molt: error: --resume {run_dir}: its checkpoint is at step 5, the run's 5 steps; pass --steps above 5"
    ]
    fewer = _error(capsys, "--resume", str(run_dir), "--steps", "4")
    assert fewer[-1].endswith("the run's 4 steps; pass --steps above 5")


def test_resume_keeps_the_plan_and_adds_what_the_command_line_gives(tmp_path, tiny_qwen3):
    from molt.stack.up import UpOptions, resume_plan

    run_dir = _run(tmp_path, tiny_qwen3, steps=5, saved=3)
    opts = UpOptions(resume=run_dir, steps=8, extra={"trainer": ["--actor.adam.lr", "1e-4"]}, progress=False)
    plan = resume_plan(opts)
    assert plan.run_dir == run_dir.resolve() and plan.steps == 8 and plan.model == tiny_qwen3
    assert plan.trainer[-2:] == ["--actor.adam.lr", "1e-4"]  # after the saved flags: it wins
    assert plan.agents == {"tiny": Path("agent.py")} and not plan.progress
    saved = json.loads((run_dir / PLAN_FILE).read_text())
    assert saved["trainer"] == ["--ckpt.path", str(run_dir / "ckpt"), "--actor.adam.lr", "1e-3"]


def test_a_run_folder_in_use_by_another_molt_up_is_refused(tmp_path, capsys):
    """A resume typed in a second terminal while the run goes on would write the same checkpoints and logs."""
    import os

    from molt.stack.up import lock_run_dir

    held = lock_run_dir(tmp_path, "--resume")
    with pytest.raises(SystemExit) as exit_:
        lock_run_dir(tmp_path, "--resume")
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"molt: error: --resume {tmp_path}: a molt up is running in it (pid {os.getpid()}); stop it first"
    ]
    held.close()  # the run ended: the folder is free again
    lock_run_dir(tmp_path, "--resume").close()
