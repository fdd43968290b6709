"""Env-worker overhead and sandbox cost, each against its peer measured in the same run.

1. Episodes through a worker (``python -m services.envs``, its own process, HTTP) vs the same runner
   called in-process (no worker hop), both against the fake gateway (``molt.agents.testing``, its own
   process), at several concurrencies: episodes/s and p50/p99 latency; ratio worker / direct.
2. ``molt.agents.sandbox.run_python`` (bwrap: namespaces + limits; none: limits + audit hook) vs a bare
   ``python -I -c`` subprocess: p50 latency of a trivial program; ratio sandbox / bare.

    .venv/bin/python -m bench.envs [--episodes 400] [--concurrency 1 64]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]

from molt.agents import Episode
from molt.agents.base import load_agent_runner
from molt.agents.gateway import GatewayClient
from molt.agents.sandbox import bwrap_status, run_python
from molt.serve import cpu_env

AGENT = ROOT / "examples" / "agents" / "math.py"
FAKE_GATEWAY = """
import socket, sys, uvicorn
from molt.agents.testing import FakeGateway
sock = socket.socket(); sock.bind(("127.0.0.1", 0))
print(f"http://127.0.0.1:{sock.getsockname()[1]}", flush=True)
app = FakeGateway(policy=lambda prompt, turn: "The answer is 4.").app
uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False)).run(sockets=[sock])
"""


def _start(argv: list[str], pattern: str) -> tuple[subprocess.Popen, str]:
    env = cpu_env({**os.environ, "PYTHONPATH": str(ROOT)})
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    line = proc.stdout.readline().strip()
    assert pattern in line, f"{argv[:3]} did not start: {line!r}"
    return proc, line[line.index("http") :]


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def _drive(n: int, concurrency: int, one) -> tuple[float, list[float]]:
    lat: list[float] = []
    sem = asyncio.Semaphore(concurrency)

    async def run(i: int) -> None:
        async with sem:
            t = time.perf_counter()
            await one(i)
            lat.append(time.perf_counter() - t)

    start = time.perf_counter()
    await asyncio.gather(*[run(i) for i in range(n)])
    return n / (time.perf_counter() - start), lat


async def bench_worker(gateway_url: str, worker_url: str, episodes: int, concurrencies: list[int]) -> None:
    runner = load_agent_runner(AGENT, "bench_math")
    gateway = GatewayClient(gateway_url)
    http = httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=None))

    async def direct(i: int) -> None:
        out = await runner.execute(Episode(prompt="What is 2+2?", group_id="b", sample_index=i, label="4"), gateway)
        assert out.reward == 1.0

    async def via_worker(i: int) -> None:
        r = await http.post(
            f"{worker_url}/v1/episodes:run",
            json={"agent": "math", "prompt": "What is 2+2?", "label": "4", "group_id": "b", "sample_index": i},
        )
        assert r.status_code == 200 and r.json()["reward"] == 1.0, r.text

    await _drive(20, 4, direct)  # warm-up both paths
    await _drive(20, 4, via_worker)
    print("| concurrency | direct ep/s | worker ep/s | ratio | direct p50 ms | worker p50 ms | worker p99 ms |")
    print("|---|---|---|---|---|---|---|")
    for c in concurrencies:
        d_rate, d_lat = await _drive(episodes, c, direct)
        w_rate, w_lat = await _drive(episodes, c, via_worker)
        print(
            f"| {c} | {d_rate:.0f} | {w_rate:.0f} | {w_rate / d_rate:.2f} | {_pct(d_lat, 0.5) * 1e3:.1f} | "
            f"{_pct(w_lat, 0.5) * 1e3:.1f} | {_pct(w_lat, 0.99) * 1e3:.1f} |"
        )
    await http.aclose()
    await gateway.aclose()


async def bench_sandbox(runs: int) -> None:
    async def bare() -> None:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-I", "-c", "print(1)", stdout=asyncio.subprocess.PIPE
        )
        await proc.communicate()

    rows = [("bare python -I", bare)]
    for iso in ["none"] + (["bwrap"] if bwrap_status()[0] else []):

        async def sandboxed(iso=iso) -> None:
            assert (await run_python("print(1)", isolation=iso)).stdout == "1\n"

        rows.append((f"sandbox ({iso})", sandboxed))
    p50 = {}
    for name, fn in rows:
        await fn()
        lat = []
        for _ in range(runs):
            t = time.perf_counter()
            await fn()
            lat.append(time.perf_counter() - t)
        p50[name] = statistics.median(lat)
    print("\n| program | p50 ms | ratio vs bare |\n|---|---|---|")
    for name, v in p50.items():
        print(f"| {name} | {v * 1e3:.1f} | {v / p50['bare python -I']:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--episodes", type=int, default=400)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--sandbox-runs", type=int, default=30)
    args = ap.parse_args()
    gw, gw_url = _start([sys.executable, "-c", FAKE_GATEWAY], "http://")
    worker, worker_url = _start(
        [
            sys.executable,
            "-m",
            "services.envs",
            "--agent",
            f"math={AGENT}",
            "--gateway.url",
            gw_url,
            "--server.log_level",
            "warning",
        ],
        "listening on",
    )
    try:
        asyncio.run(bench_worker(gw_url, worker_url, args.episodes, args.concurrency))
        asyncio.run(bench_sandbox(args.sandbox_runs))
    finally:
        for p in (worker, gw):
            p.terminate()
            p.wait(30)


if __name__ == "__main__":
    main()
