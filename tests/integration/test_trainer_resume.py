"""Kill the trainer between consuming and acking, restart from the checkpoint: every produced
trajectory is trained exactly once across both runs (real Redis, real subprocesses, SIGKILL by pid)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from collections import Counter

from molt.bus.redis_stream import RedisTrajectoryQueue
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


def _read_all(redis_url, stream):
    async def go():
        q = RedisTrajectoryQueue(redis_url, stream)
        out = await q.read("trainer-a", 100, block_s=0.1)
        await q.close()
        return out

    return asyncio.run(go())


def _wait_for(path, needle, proc, timeout_s=120):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and needle in path.read_text():
            return
        if proc.poll() is not None:
            raise AssertionError(f"trainer exited {proc.returncode} before {needle!r}:\n{path.read_text()[-3000:]}")
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {needle!r}")


def test_kill_between_consume_and_ack_trains_each_trajectory_once(tiny_qwen3, redis_url, stream_name, tmp_path):
    produced = synthetic_groups(6, 2, seed=7)
    ids = [t.trajectory_id for t in produced]
    flags = stream_flags(tiny_qwen3, redis_url, stream_name, tmp_path, "--actor.adam.lr", "1e-4")
    flags += ["--train.num_steps", "6", "--ckpt.path", str(tmp_path / "ckpt"), "--ckpt.save_steps", "2"]
    log_path = tmp_path / "run1.log"
    try:
        put(redis_url, stream_name, produced)
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                trainer_cmd() + flags,
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**env(), "MOLT_TRAINER_TEST_HOLD_BEFORE_ACK_STEP": "4"},
            )
        try:
            _wait_for(log_path, "holding before ack of step 4", proc)
            backlog = lag(redis_url, stream_name)
            # all 12 were read at once: steps 1-2 acked; steps 3-4 trained + checkpointed, not acked; 5-6 read only
            assert backlog.pending == 8
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
        first = audit(tmp_path / "audit.jsonl")
        assert [e["step"] for e in first] == [1, 2, 3, 4]
        # A producer retry re-writes one trajectory of step 1 (acked) and one of step 4 (pending): never retrained.
        by_id = {t.trajectory_id: t for t in produced}
        put(redis_url, stream_name, [by_id[first[0]["trajectory_ids"][0]], by_id[first[3]["trajectory_ids"][0]]])

        proc2 = run_trainer(flags)
        assert "resume: version 4, 8 pending entries (4 already trained and now acked, 4 to train)" in proc2.stderr
        backlog = lag(redis_url, stream_name)
        assert backlog.pending == 0 and backlog.undelivered == 2  # the two re-writes, not read yet (max_steps reached)
        assert all(consumed(redis_url, stream_name, ids))
        assert _read_all(redis_url, stream_name) == []  # ...and a later read skips them as already consumed
    finally:
        delete_stream(redis_url, stream_name)
    entries = audit(tmp_path / "audit.jsonl")
    assert [e["step"] for e in entries] == [1, 2, 3, 4, 5, 6]
    assert len({e["pid"] for e in entries[:4]} | {e["pid"] for e in entries[4:]}) == 2
    trained = Counter(i for e in entries for i in e["trajectory_ids"])
    assert sorted(trained) == sorted(ids)
    assert set(trained.values()) == {1}
