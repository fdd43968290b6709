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


def _earlier_run(run_dir: Path) -> dict[str, float]:
    """A run folder as an earlier 3-step run leaves it; returns each file's mtime, to show none was touched."""
    (run_dir / "model").mkdir(parents=True)
    (run_dir / "model" / "config.json").write_text("{}")
    rows = "".join(f'{{"step": {s}, "reward_mean": 0.5, "samples": 64}}\n' for s in (1, 2, 3))
    (run_dir / "steps.jsonl").write_text(rows)
    (run_dir / "summary.json").write_text('{"steps": 3}')
    (run_dir / "trainer.log").write_text("step 3\n")
    return {str(p): p.stat().st_mtime_ns for p in run_dir.rglob("*")}


@pytest.mark.parametrize("command", [["up"], ["train-rl"], ["train-rl", "--dry-run"]])
def test_a_run_folder_holding_an_earlier_run_is_refused_before_anything_starts(tmp_path, command, tiny_qwen3):
    run_dir = tmp_path / "run"
    before = _earlier_run(run_dir)
    agent = str(ROOT / "examples" / "agents" / "math.py")
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "1 + 1?", "answer": "2"}\n')
    flags = ["--actor.model_name_or_path", str(tiny_qwen3), "--train.agent_path", agent, "--data.prompt_dataset"]
    flags += [str(data), "--data.input_key", "prompt", "--data.label_key", "answer"]
    flags = flags if command[0] == "train-rl" else ["--steps", "2"]
    proc = _molt(*command, "--run-dir", str(run_dir), "--no-progress", *flags)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"molt: error: --run-dir {run_dir}: already holds a run (model, steps.jsonl, summary.json); "
        "pick another folder, or delete this one"
    ]
    assert "[molt" not in proc.stdout  # no model built, no service started, no run folder announced
    assert {str(p): p.stat().st_mtime_ns for p in run_dir.rglob("*")} == before  # nothing written or overwritten


@pytest.mark.parametrize(
    "name",
    [
        *("steps.jsonl", "summary.json", "eval.jsonl", "reward.png", "model", "ckpt", "envs.log"),
        *("appendonlydir", "appendonly.aof"),  # the embedded Redis's stream, as Redis 7 and 6.2 keep it
    ],
)
def test_any_one_file_of_a_run_marks_the_folder_as_taken(tmp_path, capsys, name):
    from molt.stack.up import make_run_dir

    (tmp_path / name).mkdir() if "." not in name else (tmp_path / name).write_text("")  # appendonlydir: a folder
    with pytest.raises(SystemExit) as exit_:
        make_run_dir(tmp_path)
    assert exit_.value.code == 2
    assert capsys.readouterr().err.startswith(f"molt: error: --run-dir {tmp_path}: already holds a run ({name})")


def test_an_empty_folder_or_one_without_a_run_is_a_fine_run_folder(tmp_path):
    from molt.stack.up import make_run_dir

    empty = tmp_path / "empty"
    empty.mkdir()
    assert make_run_dir(empty) == empty
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("")
    (other / "prompts.jsonl").write_text("")  # `molt up` writes the recipe's prompts before the stack's own check
    assert make_run_dir(other) == other


def test_molt_export_names_a_missing_folder_and_a_folder_without_checkpoints(tmp_path, capsys):
    from molt import cli

    for ckpt, why in ((tmp_path / "nope", "no such directory"), (tmp_path, "not a checkpoint")):
        with pytest.raises(SystemExit) as exit_:
            cli.main(["export", str(ckpt), str(tmp_path / "out")])
        assert exit_.value.code == 2 and why in capsys.readouterr().err


def test_runs_started_in_the_same_second_get_their_own_default_folders(monkeypatch, tmp_path):
    from molt.stack import up

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(up.time, "strftime", lambda fmt: "20261205-090000")
    first, second = up.default_run_dir("tiny"), up.default_run_dir("tiny")
    assert (first.name, second.name) == ("tiny-20261205-090000", "tiny-20261205-090000-2")
    assert first.is_dir() and second.is_dir() and first.parent == tmp_path / "runs"  # the working directory's


@pytest.mark.parametrize("command", [["up"], ["train-rl", "--dry-run"]])
def test_an_in_memory_stream_is_refused_as_the_stack_runs_processes(command, capsys):
    from molt import cli

    try:
        code = cli.main([*command, "--redis-url", "memory://"])  # train-rl returns its status, up exits
    except SystemExit as exc:
        code = exc.code
    assert code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "molt: error: --redis-url memory://: each service runs as its own process and cannot share an in-memory "
        "stream; pass a redis:// URL, or leave --redis-url out for an embedded Redis"
    ]


def test_a_bad_trainer_flag_is_one_line_before_the_model_is_built(tmp_path, monkeypatch, capsys):
    from molt.stack import up

    def no_build(*_):
        raise AssertionError("the model was built before the trainer's flags were checked")

    monkeypatch.setattr(up, "build_model", no_build)
    monkeypatch.setattr(up, "check_redis", lambda url: None)
    opts = up.UpOptions(recipe="smollm2", run_dir=tmp_path / "run", extra={"trainer": ["--train.bogus", "1"]})
    with pytest.raises(SystemExit) as exc:
        up.run_stack(opts)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--train.bogus" in err[0], err


@pytest.mark.parametrize(
    ("service", "flags", "expected"),
    [
        ("rollout", ["--vllm.block_size", "big"], "molt (the pods' flags): error: --vllm.block_size: Input should"),
        ("gateway", ["--session.bogus", "1"], "molt (the gateway's flags): error: unknown flag(s): --session.bogus"),
        ("envs", ["--envs.max_concurrency", "0"], "molt (the env workers' flags): error: --envs.max_concurrency"),
    ],
)
def test_a_bad_service_flag_of_set_is_one_line_before_the_model_is_built(
    tmp_path, monkeypatch, capsys, service, flags, expected
):
    """`molt up --set SERVICE ...`: each service's own parse and checks run before anything starts, so a bad value
    is not found by a pod or the gateway exiting once Redis and the trainer are up."""
    from molt.stack import up

    def no_build(*_):
        raise AssertionError("the model was built before the services' flags were checked")

    monkeypatch.setattr(up, "build_model", no_build)
    monkeypatch.setattr(up, "check_redis", lambda url: None)
    opts = up.UpOptions(recipe="smollm2", run_dir=tmp_path / "run", extra={service: flags})
    with pytest.raises(SystemExit) as exc:
        up.run_stack(opts)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(expected), err


def test_the_pods_check_sees_the_weights_token_molt_up_hands_them(tmp_path, monkeypatch):
    """run_plan gives every pod a weights token this process lacks: a pod opened to the network with
    --server.allow_unauthenticated (generation) passes the check, as it starts; without it the check refuses."""
    from molt.stack import up

    monkeypatch.delenv("MOLT_WEIGHTS_TOKEN", raising=False)
    monkeypatch.delenv("MOLT_INTERNAL_TOKEN", raising=False)
    agent = tmp_path / "a.py"
    agent.write_text("")
    exposed = ["--server.host", "0.0.0.0"]
    up.check_service_flags(tmp_path, [*exposed, "--server.allow_unauthenticated"], [], [], {"a": agent})
    with pytest.raises(SystemExit):
        up.check_service_flags(tmp_path, exposed, [], [], {"a": agent})
