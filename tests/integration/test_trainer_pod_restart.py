"""Staleness holds through a pod restart: the only rollout pod restarts mid-run on base weights (version 0) and
stays out of routing (``--weights.await_push``) until the trainer, which notices the pod behind its version while
it waits for rollouts, pushes it the current weights. No step trains a token more than --train.async_queue_size
versions old, and the run still trains every prompt once.

Real Redis, a real trainer process, the real weight-sync gRPC server (recording engine) restarted on its port,
and a real HTTP env worker that only uses a ready pod (tests/integration/fleet_testlib.py).
"""

from __future__ import annotations

import subprocess
import time
from collections import Counter

import pytest

from tests.integration.fleet_testlib import Fleet
from tests.integration.trainer_testlib import (
    ROOT,
    audit,
    delete_stream,
    dispatch_flags,
    env,
    grpo_run_flags,
    trainer_cmd,
)

pytestmark = [pytest.mark.redis, pytest.mark.timeout(300)]
PROMPTS, N, QUEUE = 8, 2, 1


def test_restarted_pod_joins_at_the_trainers_version_and_staleness_stays_bounded(
    tiny_qwen3, redis_url, stream_name, tmp_path
):
    audit_path, log_path = tmp_path / "audit.jsonl", tmp_path / "trainer.log"
    fleet = Fleet(tiny_qwen3, redis_url, stream_name)
    flags = [
        *dispatch_flags(tmp_path, PROMPTS, tiny_qwen3, redis_url, stream_name, fleet.url),
        "--envs.retry_backoff_s",
        "0.1",
        "--envs.retry_backoff_max_s",
        "1",
        "--rollout.grpc_targets",
        *fleet.grpc_targets,
        *grpo_run_flags(N, PROMPTS),
        "--ckpt.path",  # its final model goes next to it, not into the working directory
        str(tmp_path / "ckpt" / "checkpoints"),
        "--train.async_queue_size",
        str(QUEUE),
        "--fsdp.strategy",
        "torch",
        "--logger.steps_jsonl",
        str(audit_path),
    ]
    try:
        with open(log_path, "w") as log:
            trainer = subprocess.Popen(
                trainer_cmd() + flags, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env()
            )
        deadline = time.monotonic() + 120
        while len(audit(audit_path)) < 3:
            assert trainer.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.05)
        fleet.paused = True  # the trainer trains what it has, then waits for rollouts
        steps = -1
        while steps != len(audit(audit_path)):
            steps = len(audit(audit_path))
            time.sleep(2.0)
        pod = fleet.restart_pod(0)
        fleet.paused = False
        assert trainer.wait(180) == 0, log_path.read_text()[-4000:]
        written = dict(fleet.written)
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
        fleet.close()
        delete_stream(redis_url, stream_name)
    entries = audit(audit_path)
    assert [e["step"] for e in entries] == list(range(1, PROMPTS + 1))
    assert max(e["staleness_max"] for e in entries) <= QUEUE
    # The trainer, waiting for rollouts, noticed the pod behind and pushed it its current version.
    assert pod.applied[0] == steps and f"to version {steps}" in log_path.read_text()
    trained = Counter(t for e in entries for t in e["trajectory_ids"])
    assert set(trained.values()) == {1}
    assert Counter(written[t][2] for t in trained) == {f"q{i}": N for i in range(PROMPTS)}
