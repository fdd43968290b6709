"""Trajectory bus throughput vs raw pipelined redis-py, same server, same bytes, same run.

    .venv/bin/python -m bench.bus [--redis-url URL] [--n 5000] [--batch 100] [--rounds 3]

For 8 KB and 256 KB records it measures, for the bus (encode + validate + XADD pipeline, then
XREADGROUP + decode + validate + exactly-once check script + commit script (XACK + SADD)) and for raw
redis-py (pipelined XADD of the same encoded bytes, then XREADGROUP + one XACK per batch): produce rate,
consume rate and the end-to-end rate (records / (produce + consume time)). Prints a markdown table.
Raw and bus alternate for ``--rounds`` rounds; the table holds each side's median round and the median of
the per-round bus/raw ratios (single rounds move by +-15% on a shared box).
Both sides collect garbage after building their inputs, so the collector's debt for the fixtures
(10k trajectories) is not charged to the code under test.
No Redis URL: uses 127.0.0.1:6379 if reachable, else an embedded server.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import socket
import statistics
import time
import uuid

import numpy as np
import redis.asyncio as aioredis

from molt.bus.embedded import EmbeddedRedis
from molt.bus.redis_stream import RedisTrajectoryQueue
from molt.schema import Segment, Trajectory, encode


def make_traj(target_bytes: int) -> Trajectory:
    tokens = max(16, target_bytes // 10)  # int32 ids + float32 logprob + int32 version per action token
    half = tokens // 4
    seg = Segment(
        token_ids=np.random.randint(0, 50_000, tokens),
        action_spans=np.array([[half, tokens]]),
        logprobs=-np.random.rand(tokens - half),
        versions=np.full(tokens - half, 7),
    )
    return Trajectory(
        trajectory_id=uuid.uuid4().hex, group_id=uuid.uuid4().hex, sample_index=0, segments=[seg], reward=1.0
    )


async def bench_bus(url: str, n: int, batch: int, template: Trajectory) -> tuple[float, float]:
    q = RedisTrajectoryQueue(url, f"molt:bench:{uuid.uuid4().hex[:8]}", max_len=n + 1, trim_every=10**9)
    await q.ensure_group()
    trajs = [Trajectory(**{**template.__dict__, "trajectory_id": uuid.uuid4().hex}) for _ in range(n)]
    gc.collect()
    t0 = time.perf_counter()
    for i in range(0, n, batch):
        await q.put_many(trajs[i : i + batch])
    t1 = time.perf_counter()
    got = 0
    while got < n:
        ds = await q.read("bench", batch, block_s=1)
        got += len(ds)
        await q.ack(ds)
    t2 = time.perf_counter()
    await q.delete()
    await q.close()
    return t1 - t0, t2 - t1


async def bench_raw(url: str, n: int, batch: int, payload: bytes) -> tuple[float, float]:
    r = aioredis.from_url(url)
    stream = f"molt:bench:raw:{uuid.uuid4().hex[:8]}"
    await r.xgroup_create(stream, "g", id="0", mkstream=True)
    gc.collect()
    t0 = time.perf_counter()
    for i in range(0, n, batch):
        pipe = r.pipeline(transaction=False)
        for _ in range(min(batch, n - i)):
            pipe.xadd(stream, {"d": payload})
        await pipe.execute()
    t1 = time.perf_counter()
    got = 0
    while got < n:
        resp = await r.xreadgroup("g", "c", {stream: ">"}, count=batch, block=1000)
        entries = resp[0][1]
        got += len(entries)
        await r.xack(stream, "g", *[e[0] for e in entries])
    t2 = time.perf_counter()
    await r.delete(stream)
    await r.aclose()
    return t1 - t0, t2 - t1


def reachable() -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", 6379), timeout=0.5):
        return True
    return False


async def run(url: str, n: int, batch: int, rounds: int) -> None:
    print("| record | impl | produce rec/s | consume rec/s | end-to-end rec/s | MB/s | bus / raw |")
    print("|---|---|---|---|---|---|---|")
    for size in (8 * 1024, 256 * 1024):
        count = n if size <= 8192 else max(200, n // 16)
        template = make_traj(size)
        payload = encode(template)
        mb = len(payload) / 1e6
        runs: dict[str, list[tuple[float, float]]] = {"raw redis-py": [], "molt bus": []}
        for _ in range(rounds):
            runs["raw redis-py"].append(await bench_raw(url, count, batch, payload))
            runs["molt bus"].append(await bench_bus(url, count, batch, template))
        ratios = [sum(r) / sum(b) for r, b in zip(runs["raw redis-py"], runs["molt bus"])]
        for name, times in runs.items():
            tp, tc = sorted(times, key=sum)[len(times) // 2]  # the median round by total time
            e2e = count / (tp + tc)
            ratio = (
                f"{statistics.median(ratios):.2f} ({', '.join(f'{x:.2f}' for x in ratios)})"
                if name == "molt bus"
                else "1.00"
            )
            print(
                f"| {len(payload) / 1024:.0f} KB | {name} | {count / tp:,.0f} | {count / tc:,.0f} | "
                f"{e2e:,.0f} | {e2e * mb:,.0f} | {ratio} |"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--redis-url")
    ap.add_argument("--n", type=int, default=5000)
    ap.add_argument("--batch", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if args.redis_url:
        asyncio.run(run(args.redis_url, args.n, args.batch, args.rounds))
    elif reachable():
        asyncio.run(run("redis://127.0.0.1:6379/0", args.n, args.batch, args.rounds))
    else:
        with EmbeddedRedis() as server:
            asyncio.run(run(server.url, args.n, args.batch, args.rounds))


if __name__ == "__main__":
    main()
