"""``--vllm.dtype auto`` on a CPU pod: vLLM's choice (bf16) only where the CPU multiplies bf16 natively."""

import pytest

from services.rollout.cpu_dtype import cpu_flags, cpu_serving_dtype

AVX2 = frozenset({"fpu", "sse4_2", "avx", "avx2", "fma", "f16c"})


@pytest.mark.parametrize("native", ["avx512_bf16", "amx_bf16", "bf16"])
def test_auto_is_vllms_choice_where_bf16_is_native(native):
    assert cpu_serving_dtype("auto", AVX2 | {native}) == "auto"


def test_auto_is_float32_where_bf16_would_be_emulated():
    assert cpu_serving_dtype("auto", AVX2 | {"avx512f"}) == "float32"


@pytest.mark.parametrize("explicit", ["bfloat16", "float16", "float32", "half"])
def test_an_explicit_dtype_is_taken_as_given(explicit):
    assert cpu_serving_dtype(explicit, AVX2) == explicit


def test_unknown_flags_leave_the_choice_to_vllm():
    assert cpu_serving_dtype("auto", frozenset()) == "auto"


def test_this_machines_flags_are_read():
    flags = cpu_flags()
    assert not flags or "fpu" in flags or "fp" in flags  # x86 "flags" or aarch64 "Features"
