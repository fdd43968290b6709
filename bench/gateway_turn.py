"""The gateway's own CPU per request, in process: edge, routing, handlers and core, without sockets or a model.

    python -m bench.gateway_turn [--model DIR] [--sessions 2000] [--repeats 5]

Calls the gateway's ASGI app directly, one request at a time, with a pod transport that answers at once with
a fixed 4-token reply (``InstantTransport``). What it measures is the code path ``bench/gateway.py`` cannot
separate from uvicorn, the kernel and the neighbours: per request, the CPU time of this thread
(``time.thread_time``) for
  - open:   ``POST /v1/sessions``;
  - first:  a session's first chat turn (``POST /s/{id}/v1/chat/completions``, a new prompt each: template
            render and tokenize, no prompt-cache hit);
  - next:   a second turn on the same session (the reply and a new user message appended);
  - finish: ``POST /v1/episodes`` with every session at once (per session: build, encode, write to an in-memory
            stream);
  - burst:  per answer, when ``--burst`` first turns wait on the pod stream and their answers arrive together (a
            vLLM engine step finishes its batch at once): from the answers' arrival until the last response is
            handed to the server. The last answer of a burst waits for all the others: at c=64 this is what the
            "added" latency of ``bench/gateway.py`` is made of.
Best of ``--repeats`` (the least disturbed run) and the median, in microseconds. Compare runs of two trees
alternately on the same machine: this box's speed drifts between minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
from molt.serve import apply_cpu_env

apply_cpu_env()

from molt.bus.memory import MemoryTrajectoryQueue
from molt.config import parse_settings
from services.gateway.app import build_app
from services.gateway.chat import ChatModel
from services.gateway.config import GatewaySettings
from services.gateway.transport import PodTransport, json_loads

POD = "http://pod-0:8000"


class InstantTransport(PodTransport):
    """Answers every generate call at once with the same 4 tokens (what a rollout pod's answer looks like)."""

    def __init__(self, token_ids: list[int]) -> None:
        self.answer = json.dumps(
            {
                "outputs": [{"token_ids": token_ids, "logprobs": [-0.25] * len(token_ids), "finish_reason": "length"}],
                "policy_version": 1,
            }
        ).encode()

    async def get(self, url: str, timeout_s: float) -> int:
        return 200

    async def post_json(self, url: str, body: bytes) -> tuple[int, bytes, float]:
        return 200, self.answer, time.perf_counter()


class BurstChannel:
    """A pod stream whose answers are held until ``release()``, then all handed over in one go, as a vLLM pod's
    engine step finishes a batch of turns together (parsed and resolved as ``channel._Stream`` does)."""

    supported = True

    def __init__(self, answer: bytes) -> None:
        self.answer = answer
        self.waiting: list[asyncio.Future] = []

    async def generate(self, body: bytes, on_tokens=None):  # on_tokens: a streamed turn; this pod answers whole
        future = asyncio.get_running_loop().create_future()
        self.waiting.append(future)
        sent = time.perf_counter()
        answer, answered = await future
        return 200, answer, sent, answered

    def release(self) -> None:
        waiting, self.waiting = self.waiting, []
        at = time.perf_counter()
        for future in waiting:
            future.set_result((json_loads(self.answer), at))

    def close(self) -> None:
        pass


async def call(app, method: str, path: str, body: dict | None = None) -> tuple[int, bytes]:
    """One request through the app, as uvicorn would pass it."""
    raw = json.dumps(body).encode() if body is not None else b""
    sent = False
    status, chunks = 0, []

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [
            (b"host", b"gw"),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(raw)).encode()),
        ],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }

    async def receive():
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": raw, "more_body": False}

    async def send(message):
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        else:
            chunks.append(message.get("body", b""))

    await app(scope, receive, send)
    return status, b"".join(chunks)


async def one_run(app, n: int, prompt: int) -> dict[str, float]:
    cpu = time.thread_time
    t = cpu()
    sids = []
    for _ in range(n):
        status, body = await call(app, "POST", "/v1/sessions", {})
        assert status == 201, body
        sids.append(json.loads(body)["session_id"])
    out = {"open": cpu() - t}
    first = [[{"role": "user", "content": f"What is {prompt + i} + 2? Answer in one word."}] for i in range(n)]
    replies = []
    t = cpu()
    for sid, messages in zip(sids, first):
        status, body = await call(
            app, "POST", f"/s/{sid}/v1/chat/completions", {"model": "policy", "messages": messages}
        )
        assert status == 200, body
        replies.append(body)
    out["first"] = cpu() - t
    nexts = [
        [*m, json.loads(r)["choices"][0]["message"], {"role": "user", "content": "And times 3?"}]
        for m, r in zip(first, replies)
    ]
    t = cpu()
    for sid, messages in zip(sids, nexts):
        status, body = await call(
            app, "POST", f"/s/{sid}/v1/chat/completions", {"model": "policy", "messages": messages}
        )
        assert status == 200, body
    out["next"] = cpu() - t
    t = cpu()
    status, body = await call(
        app, "POST", "/v1/episodes", {"episodes": [{"session_id": s, "reward": 1.0} for s in sids]}
    )
    out["finish"] = cpu() - t
    assert status == 200 and json.loads(body)["written"] == n, body[:300]
    return {k: v / n * 1e6 for k, v in out.items()}


async def burst_run(app, channel: BurstChannel, burst: int, rounds: int, prompt: int) -> float:
    """CPU per answer when ``burst`` first turns wait on the pod and their answers arrive together: from the
    answers' arrival until every response has been handed to the server."""
    total = 0.0
    for r in range(rounds):
        sids = []
        for _ in range(burst):
            status, body = await call(app, "POST", "/v1/sessions", {})
            sids.append(json.loads(body)["session_id"])
        first = prompt + r * burst
        bodies = [
            {
                "model": "policy",
                "messages": [{"role": "user", "content": f"What is {first + i} + 2? Answer in one word."}],
            }
            for i in range(burst)
        ]
        tasks = [
            asyncio.ensure_future(call(app, "POST", f"/s/{sid}/v1/chat/completions", body))
            for sid, body in zip(sids, bodies)
        ]
        while len(channel.waiting) < burst:
            await asyncio.sleep(0)
        t = time.thread_time()
        channel.release()
        done = await asyncio.gather(*tasks)
        total += time.thread_time() - t
        assert all(status == 200 for status, _ in done), done[0]
        await call(app, "POST", "/v1/episodes", {"episodes": [{"session_id": s, "reward": 0.0} for s in sids]})
    return total / (burst * rounds) * 1e6


async def main_async(args) -> list[dict[str, float]]:
    model = ChatModel(args.model)
    settings = parse_settings(
        GatewaySettings, ["--model.path", args.model, "--rollout.urls", POD, "--session.max_length", "1024"]
    )
    reply = model.encode("Five.")[:3] + model.eos_token_ids
    queue = MemoryTrajectoryQueue(max_len=1 << 30)
    transport = InstantTransport(reply)
    app = build_app(settings, transport=transport, queue=queue, model=model)
    pod = app.gateway.pool.get(POD)
    gc.collect()
    gc.freeze()  # as the gateway's main() does
    runs = []
    await one_run(app, 100, 1 << 20)  # warm-up
    for r in range(args.repeats):
        pod.channel = None  # one call per turn, answered at once
        runs.append(await one_run(app, args.sessions, r * args.sessions))
        pod.channel = BurstChannel(transport.answer)
        runs[-1]["burst"] = await burst_run(
            app, pod.channel, args.burst, max(1, args.sessions // args.burst), (1 << 24) + r * args.sessions
        )
        queue.entries.clear()
        queue.order.clear()
        queue.cursor = 0
        app.gateway.reap(now=time.monotonic() + 1e9)  # drop the finished sessions
    return runs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(ROOT / ".cache" / "models" / "tiny-qwen3"))
    p.add_argument("--sessions", type=int, default=2000, help="Sessions per run (each: open, two turns, finish).")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--burst", type=int, default=32, help="Answers that arrive together in the burst figure.")
    args = p.parse_args()
    if not (Path(args.model) / "config.json").exists():
        from molt.models.tiny import build_tiny

        build_tiny(args.model)
    runs = asyncio.run(main_async(args))
    print(
        f"# gateway CPU per request, in process (thread CPU, us), {args.sessions} sessions x {args.repeats} runs, "
        f"model {Path(args.model).name}"
    )
    print("| request | best | median |")
    print("|---|---|---|")
    for k in ("open", "first", "next", "finish", "burst"):
        xs = [r[k] for r in runs]
        print(f"| {k} | {min(xs):.1f} | {statistics.median(xs):.1f} |")


if __name__ == "__main__":
    main()
