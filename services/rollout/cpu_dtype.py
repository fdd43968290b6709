"""What ``--vllm.dtype auto`` means on a CPU pod.

vLLM's "auto" serves bf16 on every x86 and aarch64 CPU (an fp32 checkpoint downcast included). Where the CPU
has no bf16 multiply instructions (AVX512-BF16 or AMX on x86, FEAT_BF16 on aarch64), torch emulates those
matrix products at a small fraction of fp32's speed, so there "auto" serves float32: faster, and the same
numbers as an fp32 trainer. An explicit ``--vllm.dtype`` is always taken as given.
"""

from __future__ import annotations

BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})
"""/proc/cpuinfo flags of native bf16 multiplies: x86 AVX512-BF16 and AMX-BF16, aarch64 FEAT_BF16."""


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (x86 ``flags``, aarch64 ``Features``); empty where unreadable."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


def cpu_serving_dtype(dtype: str, flags: frozenset[str]) -> str:
    """The dtype to hand vLLM for ``--vllm.dtype`` ``dtype`` on a CPU with ``flags``: "float32" for "auto"
    where the flags are known and name no bf16 multiply; otherwise ``dtype`` unchanged (vLLM decides "auto")."""
    if dtype == "auto" and flags and not flags & BF16_FLAGS:
        return "float32"
    return dtype
