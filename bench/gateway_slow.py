"""Slow clients against a real gateway: how many normal requests are served while thousands of connections
dribble their request heads.

    python -m bench.gateway_slow [--slow 20000] [--normal 20] [--window-s 20] [--gateway-arg=--flag=value ...]

Starts one gateway (tiny model's tokenizer, in-memory queue, a model-free pod), then
``--slow`` connections from ``--workers`` processes (each process holds its share, under this machine's
open-file limit), each sending a request head one byte a second and reconnecting at once whenever the gateway
drops it, as a slowloris client does. Once they are open, ``--normal`` requests (``POST /v1/sessions``, each
on a new connection, spaced over ``--window-s``) are sent; a request counts as served when it gets its 201
within ``--request-timeout-s``. Prints the served share and how often the gateway dropped a slow connection.
Without the guard (``--gateway-arg=--server.max_pending_connections=1000000
--gateway-arg=--server.header_timeout_s=100000``) the slow connections take every file descriptor.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import resource
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

HEAD = b"POST /v1/sessions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\nX-Slow: "


async def _slow_one(host: str, port: int, stop_at: float, stats: dict) -> None:
    """One slowloris client: connect, send a head one byte a second, reconnect whenever dropped."""
    while time.monotonic() < stop_at:
        try:
            reader, writer = await asyncio.open_connection(host, port)
        except OSError:
            stats["refused"] += 1
            await asyncio.sleep(0.5)
            continue
        stats["open"] += 1
        try:
            writer.write(HEAD)
            while time.monotonic() < stop_at:
                try:
                    data = await asyncio.wait_for(reader.read(1024), 1.0)
                except TimeoutError:
                    writer.write(b"x")  # one more byte of a head that never ends
                    continue
                if not data:
                    stats["dropped"] += 1
                    break
        except OSError:
            stats["dropped"] += 1
        finally:
            stats["open"] -= 1
            writer.close()


def _slow_worker(host: str, port: int, n: int, stop_at_wall: float, out) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    stats = {"open": 0, "dropped": 0, "refused": 0}

    async def main() -> None:
        stop_at = time.monotonic() + (stop_at_wall - time.time())
        tasks = []
        for i in range(n):
            tasks.append(asyncio.ensure_future(_slow_one(host, port, stop_at, stats)))
            if i % 200 == 199:
                await asyncio.sleep(0.02)  # not all at once: the listen backlog is finite
        await asyncio.gather(*tasks)

    asyncio.run(main())
    out.put({"dropped": stats["dropped"], "refused": stats["refused"]})


async def _normal(url: str, n: int, window_s: float, timeout_s: float, failures: list[str]) -> list[float | None]:
    """``n`` session opens on fresh connections spaced over ``window_s``: each one's latency, or None (and why,
    in ``failures``)."""
    import httpx

    async def one() -> float | None:
        t0 = time.perf_counter()
        try:
            async with httpx.AsyncClient(timeout=timeout_s) as client:
                r = await client.post(f"{url}/v1/sessions", json={})
            if r.status_code == 201:
                return time.perf_counter() - t0
            failures.append(f"HTTP {r.status_code}")
        except httpx.HTTPError as exc:
            failures.append(type(exc).__name__)
        return None

    tasks = []
    for _ in range(n):
        tasks.append(asyncio.ensure_future(one()))
        await asyncio.sleep(window_s / n)
    return list(await asyncio.gather(*tasks))


def run(
    model: str,
    slow: int,
    normal: int,
    *,
    window_s: float = 20.0,
    ramp_s: float = 10.0,
    workers: int = 4,
    request_timeout_s: float = 10.0,
    gateway_args: list[str] | None = None,
    prefix: list[str] | None = None,
    log_dir: Path | None = None,
) -> dict:
    """Start a gateway, hold ``slow`` slow connections, send ``normal`` requests; the figures."""
    from tests.gateway_testlib import start_gateway, start_instant_pod, stop

    log_dir = log_dir or Path(tempfile.mkdtemp(prefix="bench-gateway-slow-"))
    pod, pod_url = start_instant_pod(log_dir / "pod.log")
    try:
        proc, url = start_gateway(
            ["--model.path", model, "--rollout.urls", pod_url, "--redis.url", "memory://", *(gateway_args or [])],
            log_dir / "gateway.log",
            prefix=prefix,
        )
    except BaseException:
        stop(pod)
        raise
    host, port = url.rsplit("/", 1)[-1].rsplit(":", 1)
    try:
        stop_at = time.time() + ramp_s + window_s + request_timeout_s
        ctx = multiprocessing.get_context("spawn")
        out = ctx.Queue()
        procs = [
            ctx.Process(
                target=_slow_worker, args=(host, int(port), slow // workers + (i < slow % workers), stop_at, out)
            )
            for i in range(workers)
        ]
        for p in procs:
            p.start()
        time.sleep(ramp_s)  # the slow connections are open (or being dropped and reopened) by now
        t0 = time.monotonic()
        failures: list[str] = []
        latencies = asyncio.run(_normal(url, normal, window_s, request_timeout_s, failures))
        elapsed = time.monotonic() - t0
        stats = [out.get(timeout=ramp_s + window_s + 60) for _ in procs]
        for p in procs:
            p.join(30)
        alive = proc.poll() is None
    finally:
        stop(proc)
        stop(pod)
    served = [x for x in latencies if x is not None]
    return {
        "slow": slow,
        "normal": normal,
        "served": len(served),
        "served_share": len(served) / max(1, normal),
        "served_p50_ms": sorted(served)[len(served) // 2] * 1e3 if served else None,
        "failures": failures,
        "slow_dropped": sum(s["dropped"] for s in stats),
        "slow_refused": sum(s["refused"] for s in stats),
        "window_s": round(elapsed, 1),
        "gateway_alive": alive,
        "gateway_args": gateway_args or [],
        "log": str(log_dir / "gateway.log"),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(ROOT / ".cache" / "models" / "tiny-qwen3"))
    p.add_argument("--slow", type=int, default=20000)
    p.add_argument("--normal", type=int, default=20)
    p.add_argument("--window-s", type=float, default=20.0)
    p.add_argument("--ramp-s", type=float, default=15.0)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--request-timeout-s", type=float, default=10.0)
    p.add_argument("--gateway-arg", action="append", default=[], metavar="ARG")
    args = p.parse_args()
    result = run(
        args.model,
        args.slow,
        args.normal,
        window_s=args.window_s,
        ramp_s=args.ramp_s,
        workers=args.workers,
        request_timeout_s=args.request_timeout_s,
        gateway_args=args.gateway_arg,
    )
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
