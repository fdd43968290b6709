"""Ctrl-C on `molt up`, then `molt up --resume RUN_DIR`: the run goes on in its folder where it stopped.

A user's Ctrl-C reaches `molt up` alone (every service runs in its own session). It stops the trainer first,
which finishes its step and saves a checkpoint, then the rest; `--resume` starts the same stack again from that
checkpoint. Checked from the run folder: every step 1..N trained once across both starts, no trajectory twice,
the pod on the final version, and a finished run refuses another resume without more --steps.
"""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.trainer.checkpoint import latest_dir

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
STEPS = 6


def _rows(run_dir: Path) -> list[dict]:
    path = run_dir / "steps.jsonl"
    text = path.read_text() if path.exists() else ""
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _molt_up(*args: str, **kw) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "molt.cli", "up", "--no-progress", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, **kw)


def test_an_interrupted_run_resumes_where_it_stopped(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "molt.cli", "up", "--recipe", "tiny", "--run-dir", str(run_dir), "--no-progress"]
    first = subprocess.Popen(
        [*cmd, "--steps", str(STEPS)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline = time.monotonic() + 600
        while len(_rows(run_dir)) < 2 and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert first.poll() is None, first.communicate()[0][-3000:]
        first.send_signal(signal.SIGINT)  # what Ctrl-C in its terminal sends
        out, _ = first.communicate(timeout=300)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 130, out[-3000:]
    assert f"continue this run with: molt up --resume {run_dir}" in out
    saved = latest_dir(str(run_dir / "ckpt"))
    stopped_at = len(_rows(run_dir))
    # The trainer finished the step it was in and saved it: nothing trained is lost to the interrupt.
    assert saved is not None and saved.name == f"global_step{stopped_at}", (saved, stopped_at)
    assert 2 <= stopped_at < STEPS
    assert json.loads((run_dir / "summary.json").read_text())["interrupted"] is True

    second = _molt_up("--resume", str(run_dir), timeout=900)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    rows = _rows(run_dir)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    trained = [tid for r in rows for tid in r["trajectory_ids"]]
    assert len(trained) == len(set(trained)), "a trajectory was trained twice"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["trajectories_trained"] == len(trained)
    assert summary["pod_policy_versions"] == [STEPS] == [summary["final_policy_version"]]
    assert f"resumed from {saved}" in (run_dir / "trainer.log").read_text()

    again = _molt_up("--resume", str(run_dir), timeout=120)
    assert again.returncode == 2 and again.stderr.strip().splitlines() == [
        f"molt: error: --resume {run_dir}: its checkpoint is at step {STEPS}, the run's {STEPS} steps; "
        f"pass --steps above {STEPS}"
    ]
