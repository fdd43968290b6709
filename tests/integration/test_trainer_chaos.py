"""Chaos: SIGKILL the trainer (by pid) three times during a dispatch-mode run, once in the middle of its own
weight push, restart it with --ckpt.load_enable each time, and check from the stream and the step records that
every prompt was trained exactly once, no trajectory twice, nothing is left pending, staleness stayed within
--train.async_queue_size, and the run ended with the requested steps.

Real Redis, real trainer processes, a real weight-sync gRPC server (with a recording engine standing in for
vLLM) and a real HTTP env worker that writes synthetic rollouts stamped with the pod's current version
(tests/integration/fleet_testlib.py).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import time
from collections import Counter

import pytest

from molt.bus.redis_stream import RedisTrajectoryQueue
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

pytestmark = [pytest.mark.redis, pytest.mark.timeout(600)]
PROMPTS, N = 10, 2


def _queue_state(redis_url, stream, ids):
    async def go():
        q = RedisTrajectoryQueue(redis_url, stream)
        lag, consumed = await q.lag(), await q.consumed(ids)
        await q.close()
        return lag, consumed

    return asyncio.run(go())


def _records(path) -> list[dict]:
    """The step records so far (a line being written right now is left for the next look)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            break
    return out


def _wait_then_kill(proc, audit_path, step, delay_s) -> bool:
    """SIGKILL ``proc`` ``delay_s`` after it recorded ``step``; False if it exited on its own first."""
    deadline = time.monotonic() + 180
    while not any(e["step"] >= step and e["pid"] == proc.pid for e in _records(audit_path)):
        if proc.poll() is not None:
            return False
        assert time.monotonic() < deadline, "the trainer made no progress"
        time.sleep(0.05)
    time.sleep(delay_s)
    if proc.poll() is not None:
        return False
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(30)
    return True


def test_trainer_killed_three_times_trains_every_prompt_exactly_once(tiny_qwen3, redis_url, stream_name, tmp_path):
    seed = int(os.environ.get("MOLT_CHAOS_SEED", random.randrange(1 << 16)))
    rng = random.Random(seed)
    print(f"MOLT_CHAOS_SEED={seed}")
    audit_path = tmp_path / "audit.jsonl"
    served = Fleet(tiny_qwen3, redis_url, stream_name)
    pod = served.pods[0]
    flags = [
        *dispatch_flags(tmp_path, PROMPTS, tiny_qwen3, redis_url, stream_name, served.url),
        "--envs.retry_backoff_s",
        "0.05",
        "--rollout.grpc_targets",
        *served.grpc_targets,
        *grpo_run_flags(N, PROMPTS),
        "--train.async_queue_size",
        "1",
        "--fsdp.strategy",
        "torch",
        "--ckpt.path",
        str(tmp_path / "ckpt"),
        "--ckpt.save_steps",
        "1",
        "--ckpt.load_enable",
        "--logger.steps_jsonl",
        str(audit_path),
    ]
    # Kill 1 inside the push of a version; kills 2 and 3 a random moment after a random step.
    push_kill = rng.randint(2, 4)
    random_kills = [(rng.randint(push_kill + 1, 6), rng.uniform(0, 0.5)), (rng.randint(7, 8), rng.uniform(0, 0.5))]
    pids, logs = [], []
    try:
        for attempt in range(4):
            log_path = tmp_path / f"run{attempt}.log"
            logs.append(log_path)
            with open(log_path, "w") as log:
                proc = subprocess.Popen(
                    trainer_cmd() + flags, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env()
                )
            pids.append(proc.pid)
            try:
                if attempt == 0:
                    pod.kill_during_push = (push_kill, proc.pid)
                    assert pod.killed_in_push.wait(180), log_path.read_text()[-3000:]
                    proc.wait(30)
                elif attempt <= len(random_kills):
                    _wait_then_kill(proc, audit_path, *random_kills[attempt - 1])
                else:
                    assert proc.wait(300) == 0, log_path.read_text()[-4000:]
            finally:
                if proc.poll() is None and attempt == 3:
                    proc.kill()
                    proc.wait()
        assert proc.returncode == 0
        written = dict(served.written)
        lag, consumed = _queue_state(redis_url, stream_name, list(written))
    finally:
        served.close()
        delete_stream(redis_url, stream_name)

    entries = audit(audit_path)
    assert {e["pid"] for e in entries} <= set(pids) and len({e["pid"] for e in entries}) >= 3
    effective = {e["step"]: e for e in entries}  # a step trained again after a restart replaces the lost one
    assert sorted(effective) == list(range(1, PROMPTS + 1)), [e["step"] for e in entries]
    trained = Counter(t for e in effective.values() for t in e["trajectory_ids"])
    assert set(trained.values()) == {1}  # no trajectory twice
    by_prompt = Counter(written[t][2] for t in trained)
    assert by_prompt == {f"q{i}": N for i in range(PROMPTS)}  # every prompt once, with its whole group
    samples = Counter((written[t][0], written[t][1]) for t in trained)
    assert set(samples.values()) == {1} and len(samples) == PROMPTS * N
    assert lag.pending == 0 and lag.undelivered == 0 and all(consumed)  # nothing pending; every rollout settled
    assert max(e["staleness_max"] for e in effective.values()) <= 1
    assert "resume: version" in logs[-1].read_text()
