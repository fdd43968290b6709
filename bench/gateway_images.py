"""Image turns: the gateway against calling the rollout pod directly, with one image per request.

    python -m bench.gateway_images [--requests 64] [--rounds 2] [--concurrency 1 8] [--max-tokens 4]

Starts a real rollout pod serving the tiny vision-language model (``python -m molt.models tiny --arch
idefics3``; vLLM, CPU) and a gateway, then, in the same run and alternating rounds, sends the same kind of
request both ways:
  - direct: POST pod /v1/generate with the rendered prompt's token ids (one image token) and the PNG file;
  - gateway: POST /s/{id}/v1/chat/completions with an OpenAI ``image_url`` data URL (a session opened
    beforehand), which checks and hashes the image, renders the template, calls the same pod, records the
    expanded prompt and stores the file in the trajectory.
Every request carries its own random image (no side meets the other's in a cache), and both generate exactly
``--max-tokens`` tokens. Reports requests/s of each side and their ratio, latency p50/p99 of each side, and
the gateway's own added time (its Server-Timing figure: accept to answer minus the wait on the pod).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import statistics
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
from molt.serve import apply_cpu_env

apply_cpu_env()

import httpx
import numpy as np
from PIL import Image

from services.gateway.chat import ChatModel, canonical_messages
from tests.gateway_testlib import start_gateway, start_rollout_pod, stop


def png(seed: int, size: tuple[int, int] = (64, 48)) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def openai_messages(image: bytes) -> list[dict]:
    url = "data:image/png;base64," + base64.b64encode(image).decode("ascii")
    return [
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is it?"}],
        }
    ]


async def load(n: int, concurrency: int, one) -> tuple[list[float], list[float], float]:
    """``one(i)`` for i < n, ``concurrency`` at a time; (latencies, added times, seconds)."""
    lat: list[float] = []
    added: list[float] = []
    todo = iter(range(n))

    async def worker() -> None:
        for i in todo:
            t0 = time.perf_counter()
            extra = await one(i)
            lat.append(time.perf_counter() - t0)
            if extra is not None:
                added.append(extra)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return lat, added, time.perf_counter() - t0


async def bench(pod: str, gw: str, model: ChatModel, args) -> list[dict]:
    sp = {"max_tokens": args.max_tokens, "temperature": 1.0, "ignore_eos": True}
    seeds = iter(range(1 << 30))  # every request its own image
    prompt_ids = model.encode(model.render(canonical_messages(openai_messages(png(0))), None, True))
    rows = []
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=256)) as client:

        def direct(n: int):
            images = [png(next(seeds)) for _ in range(n)]

            async def one(i: int):
                body = {
                    "prompt_token_ids": prompt_ids,
                    "images": [{"data": base64.b64encode(images[i]).decode("ascii")}],
                    "sampling_params": sp,
                }
                r = await client.post(pod + "/v1/generate", json=body)
                assert r.status_code == 200, r.text[:300]
                return None

            return one

        async def via_gateway(n: int):
            sids = []
            for _ in range(n):
                r = await client.post(gw + "/v1/sessions", json={"sampling_params": {"ignore_eos": True}})
                sids.append(r.json()["session_id"])
            bodies = [
                json.dumps(
                    {"model": "policy", "messages": openai_messages(png(next(seeds))), "max_tokens": args.max_tokens}
                )
                for _ in range(n)
            ]

            async def one(i: int):
                r = await client.post(
                    f"{gw}/s/{sids[i]}/v1/chat/completions",
                    content=bodies[i],
                    headers={"content-type": "application/json"},
                )
                assert r.status_code == 200, r.text[:300]
                timing = dict(p.strip().split(";dur=") for p in r.headers["server-timing"].split(","))
                return float(timing["gateway"])

            return one

        for c in args.concurrency:
            n = max(args.requests, 4 * c)
            await load(2 * c, c, direct(2 * c))  # warm-up both paths
            await load(2 * c, c, await via_gateway(2 * c))
            d_lat: list[float] = []
            g_lat: list[float] = []
            added: list[float] = []
            d_s = g_s = 0.0
            for _ in range(args.rounds):  # alternate so drift on a shared machine hits both paths alike
                lat, _, s = await load(n, c, direct(n))
                d_lat += lat
                d_s += s
                lat, add, s = await load(n, c, await via_gateway(n))
                g_lat += lat
                added += add
                g_s += s
            d_rps, g_rps = len(d_lat) / d_s, len(g_lat) / g_s
            rows.append(
                {
                    "concurrency": c,
                    "requests": len(g_lat),
                    "direct_rps": round(d_rps, 1),
                    "gateway_rps": round(g_rps, 1),
                    "ratio": round(g_rps / d_rps, 3),
                    "direct_p50_ms": round(1e3 * statistics.median(d_lat), 2),
                    "gateway_p50_ms": round(1e3 * statistics.median(g_lat), 2),
                    "direct_p99_ms": round(1e3 * pct(d_lat, 0.99), 2),
                    "gateway_p99_ms": round(1e3 * pct(g_lat, 0.99), 2),
                    "added_p50_ms": round(statistics.median(added), 2),
                    "added_p99_ms": round(pct(added, 0.99), 2),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(prog="python -m bench.gateway_images", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(ROOT / ".cache" / "models" / "tiny-idefics3"))
    p.add_argument("--requests", type=int, default=64, help="requests per side per round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--json", default=None, help="also write the rows as JSON here")
    p.add_argument("--pod-url", default=None, help="measure this running pod (serving --model); else one is started")
    args = p.parse_args(argv)
    model_dir = Path(args.model)
    if not (model_dir / "config.json").exists():
        from molt.models import build_tiny

        build_tiny(model_dir, arch="idefics3", seed=0)
    logs = Path(tempfile.mkdtemp(prefix="bench-gw-images-"))
    pod, pod_url = (None, args.pod_url) if args.pod_url else start_rollout_pod(model_dir, logs / "pod.log")
    gw = None
    try:
        gw, gw_url = start_gateway(
            ["--model", str(model_dir), "--rollout.urls", pod_url, "--redis.url", "memory://"], logs / "gateway.log"
        )
        rows = asyncio.run(bench(pod_url, gw_url, ChatModel(model_dir), args))
    finally:
        if gw is not None:
            stop(gw)
        if pod is not None:
            stop(pod)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
