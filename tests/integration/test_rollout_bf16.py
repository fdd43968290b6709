"""A pod serving in bf16 (``--vllm.dtype bfloat16`` on an fp32 checkpoint) answers requests.

On a CPU with AMX tiles vLLM's bf16 attention runs AMX instructions, which Linux allows a process only after
it asks for the tile state: without that the first request killed the pod (SIGILL) in its engine thread, or
in vLLM's spawned worker with --vllm.multiprocessing (served in test_rollout_engine_process_death.py). On other
CPUs this is plain bf16 serving. The log says once that the checkpoint is cast, not once per tensor."""

from __future__ import annotations

import sys

import pytest

from molt.serve import start_service
from services.rollout.amx import cpu_has_amx_tiles, request_amx_permission
from tests.integration.rollout_testlib import assert_serves

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]


def test_amx_permission_is_granted_where_the_cpu_has_tiles():
    assert request_amx_permission() == (cpu_has_amx_tiles() and sys.platform == "linux")


def test_a_bf16_pod_serves_and_stops_cleanly(tiny_qwen3, tmp_path):
    cmd = [sys.executable, "-m", "services.rollout", "--model", str(tiny_qwen3), "--port", "0"]
    cmd += ["--vllm.enforce_eager", "--vllm.kv_cache_memory_bytes", str(64 << 20), "--vllm.dtype", "bfloat16"]
    proc, url = start_service(cmd, log_path=tmp_path / "pod.log", timeout_s=180)
    try:
        assert_serves(url)
    finally:
        proc.terminate()
        proc.wait(60)
    log = (tmp_path / "pod.log").read_text()
    assert proc.returncode == 0, log[-3000:]
    assert "dtype=torch.bfloat16" in log
    # vLLM announces the downcast once; its warning per cast tensor while loading repeats that.
    assert "Downcasting torch.float32 to torch.bfloat16" in log and "Attempted to load weight" not in log
