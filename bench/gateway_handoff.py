"""Parking and adopting open gateway sessions (services/gateway/handoff.py) against a plain Redis write.

    python -m bench.gateway_handoff [--redis-url URL] [--sessions 1000] [--tokens 4096] [--repeats 3]

A replica that exits parks every open session before its pod's termination grace period runs out; a replica
that adopts one does it on the request that finds it. Each session here holds ``--tokens`` tokens in one
segment (with logprobs, versions, half of them generated in 8 turns) and a chat state of the same text size.
  - park:   ``SessionHandoff.park`` of all sessions (state encoded, one pipeline per 500);
  - adopt:  ``SessionHandoff.take`` of every session, 64 at a time (the Lua take, then decoded into a Session);
  - limit:  the same fields written with one plain pipelined ``HSET`` each and read back with ``HMGET``, the
            state encoded beforehand: what Redis and the client library cost alone.
Reports sessions/s and MB/s per phase and the ratio to the limit (best of ``--repeats``). Keys are deleted after.
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid

import redis.asyncio as aioredis

from services.gateway.capture import Capture, ChatState, SegmentState
from services.gateway.handoff import SessionHandoff, parked_state
from services.gateway.session import Session


def make_session(tokens: int, turns: int = 8) -> Session:
    per_turn = tokens // (2 * turns)
    ids = [(i * 7919) % 151_000 for i in range(tokens)]
    spans = [(2 * t * per_turn + per_turn, 2 * (t + 1) * per_turn) for t in range(turns)]
    generated = sum(e - s for s, e in spans)
    seg = SegmentState(ids, spans, [-0.123456789 - i * 1e-4 for i in range(generated)], [3] * generated)
    text = "lorem ipsum dolor sit amet " * (tokens // 6)
    chat = ChatState([{"role": "user", "content": text}], None, text, {"role": "assistant", "content": "ok"}, "ok")
    return Session(
        id=uuid.uuid4().hex,
        owner="bench-key",
        group_id="g",
        sample_index=0,
        label=None,
        env_name="bench",
        env_version="",
        sampling_params={"temperature": 1.0},
        metadata={},
        capture=Capture(max_length=2 * tokens, segments=[seg], chat=chat),
    )


async def one_run(redis, stream: str, sessions: list[Session], concurrency: int) -> dict:
    handoff = SessionHandoff(redis, stream)
    out: dict = {}
    t = time.perf_counter()
    await handoff.park(sessions, 3600)
    out["park"] = time.perf_counter() - t

    gate = asyncio.Semaphore(concurrency)

    async def take(s: Session) -> None:
        async with gate:
            got = await handoff.take(s.id, s.owner)
            assert got is not None and got.capture.num_tokens() == s.capture.num_tokens()

    t = time.perf_counter()
    await asyncio.gather(*(take(s) for s in sessions))
    out["adopt"] = time.perf_counter() - t

    payloads = [parked_state(s) for s in sessions]  # encoded beforehand: the limit is Redis alone
    out["bytes"] = sum(len(v) for fields in payloads for v in fields.values())
    t = time.perf_counter()
    for i in range(0, len(sessions), 500):
        pipe = redis.pipeline(transaction=False)
        for s, fields in zip(sessions[i : i + 500], payloads[i : i + 500]):
            pipe.hset(f"{stream}:raw:{s.id}", mapping=fields)
        await pipe.execute()
    out["raw_write"] = time.perf_counter() - t

    async def get(s: Session) -> None:
        async with gate:
            assert (await redis.hmget(f"{stream}:raw:{s.id}", "state", "segments"))[1]

    t = time.perf_counter()
    await asyncio.gather(*(get(s) for s in sessions))
    out["raw_read"] = time.perf_counter() - t
    return out


async def run(args) -> list[dict]:
    redis = aioredis.from_url(args.redis_url)
    stream = f"molt:bench:handoff:{uuid.uuid4().hex[:8]}"
    sessions = [make_session(args.tokens) for _ in range(args.sessions)]
    runs = []
    try:
        for _ in range(args.repeats):
            runs.append(await one_run(redis, stream, sessions, args.concurrency))
    finally:
        keys = [k async for k in redis.scan_iter(match=f"{stream}*")]
        if keys:
            await redis.delete(*keys)
        await redis.aclose()
    return runs


def report(runs: list[dict], args) -> str:
    best = {k: min(r[k] for r in runs) for k in ("park", "adopt", "raw_write", "raw_read")}
    mb = runs[0]["bytes"] / 1e6
    n = args.sessions
    lines = [
        f"# {n} sessions x {args.tokens} tokens ({mb / n * 1e3:.0f} KB parked each), best of {args.repeats}",
        "| phase | s | sessions/s | MB/s | ours / plain Redis |",
        "|---|---|---|---|---|",
    ]
    for phase, limit in (("park", "raw_write"), ("adopt", "raw_read")):
        lines.append(
            f"| {phase} | {best[phase]:.3f} | {n / best[phase]:.0f} | {mb / best[phase]:.0f} | "
            f"{best[limit] / best[phase]:.2f} |"
        )
    for phase in ("raw_write", "raw_read"):
        lines.append(
            f"| plain {phase.split('_')[1]} | {best[phase]:.3f} | {n / best[phase]:.0f} | "
            f"{mb / best[phase]:.0f} | 1.00 |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    p.add_argument("--sessions", type=int, default=1000)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--concurrency", type=int, default=64, help="Adoptions in flight at once.")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    print(report(asyncio.run(run(args)), args))


if __name__ == "__main__":
    main()
