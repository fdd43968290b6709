"""bf16 vs fp32 matrix products on this CPU: what ``--vllm.dtype auto`` should serve here.

    OMP_NUM_THREADS=1 python -m bench.cpu_dtype [--tokens 256] [--repeats 5]

Times ``torch.nn.functional.linear`` at SmolLM2-135M's shapes (hidden 576 -> MLP 1536, and the 49152-token
head) in float32 and bfloat16 with one thread, as a pod's forward pass runs them. Prints GFLOP/s per dtype,
the bf16 / fp32 speed ratio, the CPU's bf16 flags and what the pod makes of "auto"
(services/rollout/cpu_dtype.py). A ratio well under 1 is emulated bf16: there "auto" should serve float32.
"""

from __future__ import annotations

import argparse
import time

import torch

from services.rollout.cpu_dtype import BF16_FLAGS, cpu_flags, cpu_serving_dtype

SHAPES = {"mlp 576x1536": (576, 1536), "head 576x49152": (576, 49152)}


def gflops(dtype: torch.dtype, tokens: int, shape: tuple[int, int], repeats: int) -> float:
    x = torch.randn(tokens, shape[0], dtype=dtype)
    w = torch.randn(shape[1], shape[0], dtype=dtype)
    torch.nn.functional.linear(x, w)  # untimed: first-call set-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.nn.functional.linear(x, w)
        best = min(best, time.perf_counter() - t0)
    return 2 * tokens * shape[0] * shape[1] / best / 1e9


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=256, help="rows per product (a prefill chunk)")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per product; the best is kept")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    flags = cpu_flags()
    print(f"bf16 flags: {sorted(flags & BF16_FLAGS) or 'none'}; auto serves: {cpu_serving_dtype('auto', flags)}")
    print("| product | fp32 GFLOP/s | bf16 GFLOP/s | bf16 / fp32 |")
    print("|---|---|---|---|")
    for name, shape in SHAPES.items():
        f32 = gflops(torch.float32, args.tokens, shape, args.repeats)
        b16 = gflops(torch.bfloat16, args.tokens, shape, args.repeats)
        print(f"| {name} | {f32:.1f} | {b16:.1f} | {b16 / f32:.3f} |")


if __name__ == "__main__":
    main()
