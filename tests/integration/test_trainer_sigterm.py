"""SIGTERM to a stream-mode trainer (Kubernetes' stop, a preemption): it finishes the step it is in, saves a
checkpoint of that step and the trained model, acks exactly what it trained, and exits 0; a restart trains the
rest once. Real Redis, a real trainer subprocess, the signal sent by pid, once mid-run and once while the
trainer waits on an empty stream."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections import Counter

import pytest

from services.trainer import checkpoint
from tests.integration.trainer_testlib import (
    ROOT,
    audit,
    consumed,
    delete_stream,
    env,
    lag,
    put,
    run_trainer,
    stream_flags,
    synthetic_groups,
    trainer_cmd,
)


def _flags(model, redis_url, stream, tmp):
    # no periodic save: the checkpoint found after the signal is the stop's own
    return stream_flags(model, redis_url, stream, tmp, "--train.read_block_s", "0.2", "--ckpt.save_steps", "1000") + [
        "--ckpt.path",
        str(tmp / "ckpt" / "run"),
    ]


def _steps(path):
    return [e["step"] for e in audit(path)] if path.exists() else []


def _stop_with_sigterm(cmd, log_path, until, timeout_s=120):
    """Start the trainer, send SIGTERM once ``until(steps)`` holds, and return (exit code, seconds to exit)."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env())
    try:
        deadline = time.monotonic() + timeout_s
        while not until(log_path):
            assert proc.poll() is None, f"trainer exited {proc.returncode} early:\n{log_path.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"timed out:\n{log_path.read_text()[-3000:]}"
            time.sleep(0.05)
        t0 = time.monotonic()
        os.kill(proc.pid, signal.SIGTERM)
        code = proc.wait(timeout=60)
        return code, time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.parametrize("nproc", [1, 2])
def test_sigterm_mid_run_saves_acks_the_trained_and_exits_0(nproc, tiny_qwen3, redis_url, stream_name, tmp_path):
    """With 2 ranks the signal goes to torchrun, as Kubernetes and compose send it: torchrun passes it on to
    every rank and waits --shutdown-timeout for them (the charts set it inside the pod's grace)."""
    groups = 100  # a step takes a few ms here: enough of them that the signal lands mid-run
    produced = synthetic_groups(groups, 2, seed=11)
    ids = [t.trajectory_id for t in produced]
    audit_path = tmp_path / "audit.jsonl"
    flags = _flags(tiny_qwen3, redis_url, stream_name, tmp_path)
    try:
        put(redis_url, stream_name, produced)
        cmd = trainer_cmd(nproc)
        if nproc > 1:
            cmd.insert(1, "--shutdown-timeout=60")
        code, _ = _stop_with_sigterm(cmd + flags, tmp_path / "run1.log", lambda _: len(_steps(audit_path)) >= 2)
        log = (tmp_path / "run1.log").read_text()
        done = _steps(audit_path)
        last = done[-1]
        # torchrun itself exits 1 after a signal (its SignalException), however its ranks ended: they
        # finished the step, saved and left together, which is what the log says.
        assert code == 0 if nproc == 1 else f"done: {{'steps': {last}," in log, log[-3000:]
        assert done == list(range(1, last + 1)) and last < groups, log[-3000:]
        # The step in progress was finished, then saved: the checkpoint is the last step trained.
        latest = checkpoint.latest_dir(str(tmp_path / "ckpt" / "run"))
        assert latest is not None and latest.name == f"global_step{last}"
        assert (tmp_path / "ckpt" / "config.json").exists()  # the trained model, as an HF directory
        trained = [i for e in audit(audit_path) for i in e["trajectory_ids"]]
        assert all(consumed(redis_url, stream_name, trained))
        backlog = lag(redis_url, stream_name)
        # read but untrained entries stay unacked
        assert backlog.pending + backlog.undelivered == 2 * groups - len(trained)

        # The restart resumes at that step and trains each remaining trajectory once.
        run_trainer(flags + ["--train.num_steps", str(groups)])
    finally:
        delete_stream(redis_url, stream_name)
    entries = audit(audit_path)
    assert [e["step"] for e in entries] == list(range(1, groups + 1))
    counts = Counter(i for e in entries for i in e["trajectory_ids"])
    assert sorted(counts) == sorted(ids) and set(counts.values()) == {1}


def test_sigterm_while_waiting_for_rollouts_exits_promptly(tiny_qwen3, redis_url, stream_name, tmp_path):
    audit_path = tmp_path / "audit.jsonl"
    flags = _flags(tiny_qwen3, redis_url, stream_name, tmp_path)
    try:
        put(redis_url, stream_name, synthetic_groups(2, 2, seed=12))
        code, took = _stop_with_sigterm(
            trainer_cmd() + flags,
            tmp_path / "run.log",
            # two steps trained, then an empty stream: the trainer blocks reading it
            lambda log: len(_steps(audit_path)) == 2 and "stopping" not in log.read_text(),
        )
        assert code == 0
        assert took < 30  # a blocked read is not waited out for new rollouts
        latest = checkpoint.latest_dir(str(tmp_path / "ckpt" / "run"))
        assert latest is not None and latest.name == "global_step2"
        backlog = lag(redis_url, stream_name)
        assert backlog.pending == 0 and backlog.undelivered == 0
    finally:
        delete_stream(redis_url, stream_name)
