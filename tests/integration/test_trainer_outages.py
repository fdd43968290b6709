"""Outages are waited out, not turned into data loss: a dispatch-mode trainer rides out its Redis server
stopped for 30 s (reporting not ready meanwhile) and then its env worker SIGKILLed (by itself, after six
prompts' episodes) for 15 s; both come back on the same port, and the run ends with every prompt trained
exactly once and no episode given up.

Real processes, all stopped by pid: a redis-server of the test's own (``molt.bus.embedded``, append-only file,
stopped with SIGTERM so its restart keeps the stream), a stand-in env worker (synthetic_env_worker.py) and the
trainer.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
import redis

from molt.bus.embedded import EmbeddedRedis
from molt.net import free_port
from tests.integration.trainer_testlib import ROOT, audit, dispatch_flags, env, grpo_run_flags, trainer_cmd

pytestmark = [pytest.mark.timeout(400)]
PROMPTS, N = 8, 2
REDIS_OUTAGE_S, WORKER_OUTAGE_S = 30.0, 15.0
DIE_AFTER_PROMPTS = 6
WORKER = Path(__file__).with_name("synthetic_env_worker.py")


def _wait(pred, what: str, timeout_s: float = 120, proc=None):
    deadline = time.monotonic() + timeout_s
    while not pred():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the trainer exited {proc.returncode} while waiting for {what}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _start_worker(port: int, redis_url: str, stream: str, records: Path, die_after: int | None = None):
    argv = [sys.executable, str(WORKER), str(port), redis_url, stream, str(records)]
    proc = subprocess.Popen(argv + ([str(die_after)] if die_after else []), cwd=ROOT, env=env())

    def up() -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{port}/docs", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    _wait(up, "the env worker", 60)
    return proc


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)


def _steps(path: Path, pid: int) -> int:
    return max((e["step"] for e in audit(path) if e["pid"] == pid), default=0)


def test_trainer_waits_out_redis_and_env_worker_outages(tiny_qwen3, tmp_path):
    worker_port = free_port()
    server = EmbeddedRedis(data_dir=tmp_path / "redis")
    redis_port, redis_url, stream = server.port, server.url, "molt:test:outages"
    records, audit_path, log_path = tmp_path / "written.jsonl", tmp_path / "audit.jsonl", tmp_path / "trainer.log"
    flags = [
        *dispatch_flags(tmp_path, PROMPTS, tiny_qwen3, redis_url, stream, f"http://127.0.0.1:{worker_port}"),
        "--envs.retry_backoff_s",
        "0.1",
        "--envs.retry_backoff_max_s",
        "2",
        *grpo_run_flags(N, PROMPTS),
        "--fsdp.strategy",
        "torch",
        "--ckpt.path",
        str(tmp_path / "ckpt"),
        "--ckpt.save_steps",
        "2",
        "--logger.steps_jsonl",
        str(audit_path),
        "--server.port",
        "0",
    ]
    procs: dict[str, subprocess.Popen] = {}
    try:
        server.start()
        # The worker SIGKILLs itself after DIE_AFTER_PROMPTS prompts' episodes: later in the run, not before the
        # Redis outage (dispatch runs at most --train.async_queue_size steps ahead of training).
        procs["worker"] = _start_worker(worker_port, redis_url, stream, records, DIE_AFTER_PROMPTS * N)
        with open(log_path, "w") as log:
            trainer = procs["trainer"] = subprocess.Popen(
                trainer_cmd() + flags, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env()
            )
        _wait(
            lambda: re.search(r"trainer listening on (http://\S+)", log_path.read_text()),
            "the trainer's port",
            proc=trainer,
        )
        url = re.search(r"trainer listening on (http://\S+)", log_path.read_text()).group(1)

        # Redis down for REDIS_OUTAGE_S: the trainer stays up and reports not ready.
        _wait(lambda: _steps(audit_path, trainer.pid) >= 2, "step 2", proc=trainer)
        server.stop()
        down_at = time.monotonic()
        _wait(
            lambda: httpx.get(url + "/readyz").status_code == 503,
            "readyz 503 during the Redis outage",
            30,
            proc=trainer,
        )
        assert httpx.get(url + "/readyz").json()["phase"] == "waiting_for_stream"
        time.sleep(max(0.0, REDIS_OUTAGE_S - (time.monotonic() - down_at)))
        assert trainer.poll() is None
        server.start()
        _wait(lambda: httpx.get(url + "/readyz").status_code == 200, "readyz 200 after the outage", 60, proc=trainer)

        # The env worker down for WORKER_OUTAGE_S: episodes wait for it instead of failing.
        _wait(lambda: procs["worker"].poll() is not None, "the env worker's crash", proc=trainer)
        time.sleep(WORKER_OUTAGE_S)
        assert trainer.poll() is None
        assert _steps(audit_path, trainer.pid) <= DIE_AFTER_PROMPTS  # the rest waited for the worker
        procs["worker"] = _start_worker(worker_port, redis_url, stream, records)
        assert trainer.wait(240) == 0, log_path.read_text()[-4000:]
        lag = redis.Redis(port=redis_port).xpending(stream, "trainer")
    finally:
        for proc in reversed(list(procs.values())):
            _kill(proc)
        server.stop()
    text = log_path.read_text()
    assert "failed for good" not in text and "stream back after" in text
    entries = audit(audit_path)
    assert [e["step"] for e in entries] == list(range(1, PROMPTS + 1))  # no step skipped, no early exit
    written = {r["trajectory_id"]: r for r in map(json.loads, records.read_text().splitlines())}
    trained = Counter(t for e in entries for t in e["trajectory_ids"])
    assert set(trained.values()) == {1}
    assert Counter(written[t]["prompt"] for t in trained) == {f"q{i}": N for i in range(PROMPTS)}
    assert lag["pending"] == 0
