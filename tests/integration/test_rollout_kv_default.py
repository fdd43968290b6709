"""A CPU pod started as the README shows (no KV size given) sizes its KV cache from the model and starts while
other work holds RAM (vLLM's own default, 0.9 of all RAM, refuses to start then)."""

from __future__ import annotations

import os
import sys

import httpx

from molt.serve import start_service
from services.rollout.kv_size import available_bytes, cpu_kv_cache_bytes


def hold_ram(num_bytes: int) -> bytearray:
    """``num_bytes`` of touched memory (one write per page, so the kernel really hands it out)."""
    buf = bytearray(num_bytes)
    buf[::4096] = b"\x01" * len(range(0, num_bytes, 4096))
    return buf


def test_a_cpu_pod_without_a_kv_size_sizes_it_itself_and_starts_with_ram_in_use(tiny_qwen3, tmp_path):
    held = hold_ram(min(3 << 30, available_bytes() // 4))  # a shared box: at most a quarter of what is free
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    log = tmp_path / "pod.log"
    proc, url = start_service(
        [sys.executable, "-m", "services.rollout", "--model", str(tiny_qwen3), "--port", "0", "--vllm.enforce_eager"],
        log_path=log,
        env=env,
        timeout_s=180,
    )
    try:
        out = httpx.post(
            f"{url}/v1/generate",
            json={"prompt_token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 4}},
            timeout=60,
        )
        assert out.status_code == 200 and len(out.json()["outputs"][0]["token_ids"]) == 4
    finally:
        proc.terminate()
        proc.wait(60)
    del held
    # tiny_qwen3: 2 layers x 2 KV heads x head dim 32 x 2 (K, V) x 4 bytes (float32) = 1024 B per token;
    # 2048 tokens (its max_position_embeddings) x 256 sequences x 1024 B = 512 MiB, under the cap here.
    chosen, why = cpu_kv_cache_bytes(str(tiny_qwen3), "auto", None, None, available=1 << 40)
    assert chosen == 2048 * 256 * 1024 and "2048 tokens x 256 seqs x 1024 B/token" in why
    assert "KV cache 512 MiB (2048 tokens x 256 seqs x 1024 B/token" in log.read_text()
    assert proc.returncode == 0


def test_the_kv_size_is_capped_by_a_quarter_of_available_ram(tiny_qwen3):
    # 256 MiB available: the cap is 64 MiB, below the 512 MiB the model would use.
    assert cpu_kv_cache_bytes(str(tiny_qwen3), "auto", None, None, available=256 << 20)[0] == 64 << 20
    # A short context and few sequences need less than the cap: 128 tokens x 8 seqs x 1024 B = 1 MiB -> the floor.
    assert cpu_kv_cache_bytes(str(tiny_qwen3), "float32", 128, 8, available=1 << 40)[0] == 64 << 20
    # bfloat16 halves the bytes per token: 2048 x 256 x 512 B = 256 MiB.
    assert cpu_kv_cache_bytes(str(tiny_qwen3), "bfloat16", None, None, available=1 << 40)[0] == 256 << 20
