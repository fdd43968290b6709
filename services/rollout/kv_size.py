"""The KV-cache size a CPU pod picks when none is given.

vLLM sizes its KV cache on CPU from ``gpu_memory_utilization`` applied to the machine's RAM (0.9 by default),
so a pod refuses to start as soon as other work holds a tenth of it. Without ``--vllm.kv_cache_memory_bytes``
or ``VLLM_CPU_KVCACHE_SPACE`` the pod asks for what the model needs instead:

    context (--vllm.max_model_len, else the model's) x sequences (--vllm.max_num_seqs, else 256)
    x bytes per token (2 (K and V) x layers x KV heads x head dim x dtype bytes)

capped at a quarter of the RAM available now (``MemAvailable``), and never below 64 MiB.
"""

from __future__ import annotations

import json
from pathlib import Path

DEFAULT_NUM_SEQS = 256
AVAILABLE_FRACTION = 0.25
MIN_BYTES = 64 << 20


def kv_bytes_per_token(config: dict, dtype: str) -> int:
    """K and V of one token over every layer, from an HF ``config.json`` (a text model's, or its text part)."""
    cfg = config.get("text_config") or config
    heads = cfg.get("num_attention_heads") or 1
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    name = dtype if dtype != "auto" else str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    width = 4 if "32" in name else 2
    return 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * width


def available_bytes() -> int:
    """RAM the kernel can hand out now without swapping (``MemAvailable`` of /proc/meminfo)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise OSError("no MemAvailable in /proc/meminfo")


def cpu_kv_cache_bytes(
    model_dir: str, dtype: str, max_model_len: int | None, max_num_seqs: int | None, available: int | None = None
) -> tuple[int, str]:
    """(bytes, how they were chosen) for a pod on CPU, by the rule in the module docstring."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    cfg = config.get("text_config") or config
    context = max_model_len or cfg.get("max_position_embeddings") or 4096
    seqs = max_num_seqs or DEFAULT_NUM_SEQS
    per_token = kv_bytes_per_token(config, dtype)
    need = context * seqs * per_token
    cap = int((available_bytes() if available is None else available) * AVAILABLE_FRACTION)
    chosen = max(MIN_BYTES, min(need, cap))
    why = (
        f"{context} tokens x {seqs} seqs x {per_token} B/token = {need >> 20} MiB, capped at "
        f"{AVAILABLE_FRACTION:.0%} of available RAM ({cap >> 20} MiB)"
    )
    return chosen, why
