"""A rollout pod running vLLM's engine in its own process (``--vllm.multiprocessing``) whose engine process is
SIGKILLed (by pid, as the OOM killer would): the pod fails what was in flight with a 503 instead of hanging
and exits non-zero so that Kubernetes restarts it (readiness turns 503 on the same dead flag, checked in
test_rollout_engine_death.py). The idle pod serves in bf16 before its engine dies: vLLM's spawned engine process
must ask for the CPU's AMX tile state itself (test_rollout_bf16.py checks the in-process engine)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import psutil
import pytest

from molt.serve import start_service
from tests.integration.rollout_testlib import assert_serves

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]


def _engine_processes(pod: subprocess.Popen) -> list[psutil.Process]:
    """vLLM's engine process (it names itself VLLM::EngineCore; its workers are its own children)."""
    return [c for c in psutil.Process(pod.pid).children() if c.name().startswith("VLLM::EngineCore")]


@pytest.mark.parametrize("busy", [False, True], ids=["idle", "mid-request"])
def test_killing_the_engine_process_ends_the_pod_with_a_nonzero_exit(tiny_qwen3, tmp_path, busy):
    cmd = [sys.executable, "-m", "services.rollout", "--model", str(tiny_qwen3), "--port", "0"]
    cmd += ["--vllm.enforce_eager", "--vllm.kv_cache_memory_bytes", str(64 << 20), "--vllm.multiprocessing"]
    cmd += ["--vllm.dtype", "float32" if busy else "bfloat16"]
    pod, url = start_service(cmd, log_path=tmp_path / "pod.log", timeout_s=180)
    answers: list[int] = []
    try:
        engines = _engine_processes(pod)
        assert engines, "no engine process found"
        if not busy:
            assert_serves(url)
            assert "dtype=torch.bfloat16" in (tmp_path / "pod.log").read_text()
        body = {"prompt_token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2000, "ignore_eos": True}}
        if busy:

            def long_request() -> None:
                try:
                    answers.append(httpx.post(f"{url}/v1/generate", json=body, timeout=120).status_code)
                except httpx.HTTPError:
                    answers.append(-1)  # the connection closed as the pod exited

            worker = threading.Thread(target=long_request)
            worker.start()
            time.sleep(2)  # generating
        for proc in engines:
            os.kill(proc.pid, signal.SIGKILL)
        pod.wait(90)
        if busy:
            worker.join(60)
            assert answers == [503], answers  # failed at once, not left hanging until the pod went away
    finally:
        if pod.poll() is None:
            pod.kill()
            pod.wait()
    log = (tmp_path / "pod.log").read_text()
    assert pod.returncode not in (0, None), log[-3000:]
    assert "engine process" in log and "exited with code -9" in log, log[-3000:]


def test_a_sigterm_to_the_pod_and_its_engine_together_is_a_clean_stop(tiny_qwen3, tmp_path):
    """As a supervisor that signals the whole process group does: the engine exiting first is not a death."""
    cmd = [sys.executable, "-m", "services.rollout", "--model", str(tiny_qwen3), "--port", "0"]
    cmd += ["--vllm.enforce_eager", "--vllm.dtype", "float32", "--vllm.kv_cache_memory_bytes", str(64 << 20)]
    cmd += ["--vllm.multiprocessing"]
    pod, _ = start_service(cmd, log_path=tmp_path / "pod.log", timeout_s=180)
    try:
        engines = _engine_processes(pod)
        assert engines
        for pid in [pod.pid, *(p.pid for p in engines)]:
            os.kill(pid, signal.SIGTERM)
        pod.wait(90)
    finally:
        if pod.poll() is None:
            pod.kill()
            pod.wait()
    log = (tmp_path / "pod.log").read_text()
    assert pod.returncode == 0 and "engine process" not in log, log[-3000:]
