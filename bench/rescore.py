"""What --rollout.rescore_logprobs costs: finish latency and the pod's engine time per episode, with and without.

    python -m bench.rescore [--model DIR] [--sessions 32] [--turns 3] [--max-tokens 32] [--concurrency 4] [--rounds 2]

Starts one real rollout pod (vLLM, tiny model, CPU) and two gateways in front of it, one plain and one with
--rollout.rescore_logprobs (memory queues), then alternates rounds between them: each round runs ``--sessions``
chat sessions of ``--turns`` turns (``--max-tokens`` generated tokens each, ignore_eos), ``--concurrency`` at
once, and finishes each. Reported per side: finish latency p50/p90, and the pod's seconds inside engine steps
per episode (its /v1/stats), which is where the extra prefill lands; the ratio of the two sides' engine time is
the flag's cost on the rollout fleet.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from molt.serve import apply_cpu_env

apply_cpu_env()

import httpx

from tests.gateway_testlib import start_gateway, start_rollout_pod, stop


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def episode(client: httpx.AsyncClient, gw: str, i: int, turns: int, max_tokens: int) -> float:
    """One session of ``turns`` chat turns, finished; the finish call's seconds."""
    sp = {"max_tokens": max_tokens, "ignore_eos": True}
    sid = (await client.post(gw + "/v1/sessions", json={"sampling_params": sp})).json()["session_id"]
    msgs = [{"role": "user", "content": f"Episode {i}: count from {i} upwards."}]
    for t in range(turns):
        r = await client.post(f"{gw}/s/{sid}/v1/chat/completions", json={"model": "policy", "messages": msgs})
        r.raise_for_status()
        msgs += [r.json()["choices"][0]["message"], {"role": "user", "content": f"Go on ({t})."}]
    start = time.perf_counter()
    done = await client.post(f"{gw}/v1/sessions/{sid}/finish", json={"reward": 1.0})
    took = time.perf_counter() - start
    if not done.json().get("written"):
        raise RuntimeError(f"finish wrote nothing: {done.text}")
    return took


async def one_round(gw: str, pod: str, args, offset: int) -> tuple[list[float], float]:
    """(finish seconds of each episode, the pod's engine-step seconds per episode) for one round."""
    async with httpx.AsyncClient(timeout=600) as client:
        before = (await client.get(pod + "/v1/stats")).json()["step_s"]
        gate = asyncio.Semaphore(args.concurrency)

        async def one(i: int) -> float:
            async with gate:
                return await episode(client, gw, offset + i, args.turns, args.max_tokens)

        finishes = await asyncio.gather(*(one(i) for i in range(args.sessions)))
        after = (await client.get(pod + "/v1/stats")).json()["step_s"]
    return list(finishes), (after - before) / args.sessions


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(ROOT / ".cache" / "models" / "tiny-qwen3"))
    p.add_argument("--sessions", type=int, default=32)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    if not (Path(args.model) / "config.json").exists():
        from molt.models.tiny import build_tiny

        build_tiny(args.model)
    logs = Path(tempfile.mkdtemp(prefix="bench-rescore-"))
    procs = []
    try:
        proc, pod = start_rollout_pod(args.model, logs / "pod.log")
        procs.append(proc)
        gateways = {}
        for side, extra in (("off", []), ("rescore", ["--rollout.rescore_logprobs"])):
            flags = ["--model", args.model, "--rollout.urls", pod, "--redis.url", "memory://", *extra]
            proc, url = start_gateway([*flags, "--session.max_length", "1023"], logs / f"{side}.log")
            procs.append(proc)
            gateways[side] = url
        finishes: dict[str, list[float]] = {side: [] for side in gateways}
        engine: dict[str, list[float]] = {side: [] for side in gateways}
        for gw in gateways.values():  # warm-up, unmeasured: the engine's first steps compile and allocate
            asyncio.run(one_round(gw, pod, argparse.Namespace(**{**vars(args), "sessions": 4}), -8))
        for r in range(args.rounds):  # alternated, so drift on a shared box hits both sides alike
            for k, (side, gw) in enumerate(gateways.items()):
                f, e = asyncio.run(one_round(gw, pod, args, (2 * r + k) * args.sessions))
                finishes[side] += f
                engine[side].append(e)
    finally:
        for proc in reversed(procs):
            stop(proc)
    print(
        f"# --rollout.rescore_logprobs: {args.sessions} sessions x {args.rounds} rounds per side, {args.turns} turns "
        f"of {args.max_tokens} tokens, concurrency {args.concurrency}, {Path(args.model).name}, logs {logs}"
    )
    print("| side | finish p50 ms | finish p90 ms | pod engine s per episode |\n|---|---|---|---|")
    for side in gateways:
        med = statistics.median(engine[side])
        print(f"| {side} | {pct(finishes[side], 0.5) * 1e3:.1f} | {pct(finishes[side], 0.9) * 1e3:.1f} | {med:.4f} |")
    ratio = statistics.median(engine["rescore"]) / statistics.median(engine["off"])
    print(f"pod engine time per episode, rescore / off: {ratio:.2f}")


if __name__ == "__main__":
    main()
