"""`molt up` starts a service again when it dies mid-run, as Kubernetes restarts a pod: the rollout pod, the
gateway, the embedded Redis and the trainer are each SIGKILLed by pid once, one fault per trained step, and the
run still ends with all its steps, every trajectory trained once, the pod on the final weights and the restarts
in its summary. These are the services `molt up` restarts in its own way (a pod kept out of routing until the
trainer pushes it, the trainer from its checkpoint, the gateway's count carried over, Redis on its run-folder
file); the env worker's restart is the generic one, and every service's own recovery from a kill is
tests/e2e/test_soak_short.py's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]
ROOT = Path(__file__).resolve().parents[2]
# (after this many steps trained, the service to kill): each next one only once the stack trained on
FAULTS = [(1, "rollout-0"), (2, "gateway"), (3, "redis"), (4, "trainer")]
STEPS = 6
MODULES = {
    "rollout-0": "services.rollout",
    "gateway": "services.gateway",
    "trainer": "services.trainer",
    "redis": "redis-server",
}


def _steps(run_dir: Path) -> list[dict]:
    try:
        text = (run_dir / "steps.jsonl").read_text()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _child(parent: int, name: str) -> int:
    """The pid of the child of ``parent`` that runs ``name``'s program."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (proc / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if ppid == parent and MODULES[name] in cmdline:
            return int(proc.name)
    raise AssertionError(f"no {name} under pid {parent}")


def test_every_service_killed_mid_run_is_started_again_and_the_run_finishes(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "molt.cli", "up", "--recipe", "tiny", "--run-dir", str(run_dir), "--no-progress"]
    cmd += ["--steps", str(STEPS), "--set", "trainer", "ckpt.save_steps=2"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for after, name in FAULTS:
            deadline = time.monotonic() + 300
            while len({r["step"] for r in _steps(run_dir)}) < after and proc.poll() is None:
                assert time.monotonic() < deadline, f"no step {after} within 300 s"
                time.sleep(0.5)
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            os.kill(_child(proc.pid, name), signal.SIGKILL)
        out, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:  # stopped as Ctrl-C would, so its own shutdown stops what it started
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=200)
    assert proc.returncode == 0, out[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["restarts"] == {name: 1 for _, name in FAULTS}, summary
    for _, name in FAULTS:
        assert f"[molt up] {name} exited with code -9; starting it again (1 of 3)" in out
    assert summary["steps"] == STEPS and summary["pod_policy_versions"] == [STEPS], summary
    # A step trained again after the trainer's restart (past its last checkpoint) replaces the lost one.
    rows = {r["step"]: r for r in _steps(run_dir)}
    assert sorted(rows) == list(range(1, STEPS + 1))
    trained = [tid for r in rows.values() for tid in r["trajectory_ids"]]
    assert len(trained) == len(set(trained)), "a trajectory was trained twice"
    assert summary["staleness_max"] <= 2, summary  # the restarted pod served no base weights
    assert "resumed from" in (run_dir / "trainer.log").read_text()
