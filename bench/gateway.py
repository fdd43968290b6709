"""Gateway overhead: added latency p50/p99 and requests/s, gateway vs calling the rollout pod directly.

    python -m bench.gateway [--model DIR] [--requests 256] [--concurrency 1 64] [--max-tokens 4] [--group-size 1]

Starts one real rollout pod (vLLM, tiny model, CPU) and one gateway (subprocesses; ``--pod-url`` reuses
a running pod), then, in the same run and alternating rounds, sends the same prompts
  - direct: POST pod /v1/generate with the prompt's token ids;
  - gateway: POST /s/{id}/v1/chat/completions (OpenAI wire, captured session opened beforehand), which
    renders the chat template, tokenizes, routes, calls the same pod, decodes and records the turn.
Both generate exactly ``--max-tokens`` tokens (ignore_eos); ``--instant-pod`` swaps the vLLM pod for a
model-free one that answers at once, which isolates what the gateway itself costs and carries; ``--relay``
runs two gateway replicas and sends every turn to the one that does not hold the session (it forwards it).
Every session's first turn is a different prompt unless ``--group-size N`` lets N sessions share one (as
the n samples of a GRPO group do; the gateway caches a first turn's render and tokens); both sides send
the same prompts, each (round, side) its own, so the pod's prefix cache favours neither.
"Added" latency is the gateway's own Server-Timing figure (accept to response, minus the time waiting
on the pod). CPU seconds per request of the gateway, the pod and this load generator (psutil) are reported
too: on a shared 2-core box they are the figures that do not depend on the neighbours' load. Targets: added
p50 < 2 ms, p99 < 10 ms, gateway throughput >= 90% of direct.
Time to first token (``--ttft-tokens``, ``--ttft-requests``): one long streamed generation at a time, direct
(the pod's generate stream, a streamed call: its first delta line) vs gateway (a streamed chat turn: its first
content chunk), each with the whole generation's time, so the first token's share of it shows.
The load generator sends prepared requests over one keep-alive connection per worker (``RawClient``, a
fraction of aiohttp's CPU per request): on a small box its CPU comes out of the same cores as the pod's
and the gateway's.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
from molt.serve import apply_cpu_env

apply_cpu_env()

import aiohttp
import psutil
import uvloop

from molt.net import free_port
from services.gateway.chat import ChatModel
from tests.gateway_testlib import start_gateway, start_instant_pod, start_rollout_pod, stop

RELAY_KEY = "bench-relay-key-0123456789"


def messages(k: int) -> list[dict]:
    """Prompt number ``k``: same shape and length class for every k, different text."""
    return [{"role": "user", "content": f"What is {k} + 2? Answer in one word."}]


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


class _Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection of the load generator: writes a prepared request, reads its response
    (Content-Length framed, or chunked as the instant pod answers). The load generator costs ~0.1 ms of CPU per
    request with it, 0.3-0.4 with aiohttp: on this 2-core box that CPU is taken from the pod and the gateway."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.waiter: asyncio.Future | None = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        end = self.buf.find(b"\r\n\r\n")
        if end < 0 or self.waiter is None:
            return
        head = bytes(self.buf[:end]).lower()
        at = head.find(b"\r\ncontent-length:")
        if at >= 0:
            eol = head.find(b"\r\n", at + 2)
            total = end + 4 + int(head[at + 17 : eol if eol > 0 else len(head)])
            if len(self.buf) < total:
                return
            body = bytes(self.buf[end + 4 : total])
        elif b"\r\ntransfer-encoding: chunked" in head:
            parsed = self._chunked(end + 4)
            if parsed is None:
                return
            body, total = parsed
        else:
            self.waiter.set_exception(RuntimeError(f"no content-length or chunked body in {head[:300]!r}"))
            return
        del self.buf[:total]
        waiter, self.waiter = self.waiter, None
        waiter.set_result((head, body))

    def _chunked(self, pos: int) -> tuple[bytes, int] | None:
        """(body, bytes consumed) of a whole chunked body from ``pos``, or None while it is incomplete."""
        pieces = []
        while True:
            eol = self.buf.find(b"\r\n", pos)
            if eol < 0:
                return None
            size = int(bytes(self.buf[pos:eol]).split(b";")[0], 16)
            if size == 0:
                return (b"".join(pieces), eol + 4) if len(self.buf) >= eol + 4 else None
            if len(self.buf) < eol + 4 + size:
                return None
            pieces.append(bytes(self.buf[eol + 2 : eol + 2 + size]))
            pos = eol + 4 + size

    def connection_lost(self, exc: Exception | None) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError(f"connection lost: {exc}"))

    async def request(self, data: bytes) -> tuple[bytes, bytes]:
        """(lower-cased head, body) of the answer to ``data`` (one whole request)."""
        self.waiter = asyncio.get_running_loop().create_future()
        assert self.transport is not None
        self.transport.write(data)
        return await self.waiter


class RawClient:
    """One ``_Connection`` per load worker to one server; requests are prepared bytes."""

    def __init__(self, url: str) -> None:
        host, _, port = url.split("://", 1)[1].rstrip("/").rpartition(":")
        self.host, self.port = host, int(port)
        self.conns: dict[int, _Connection] = {}

    def post(self, path: str, body: bytes, headers: dict[str, str]) -> bytes:
        extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items() if k.lower() != "content-type")
        return (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n{extra}\r\n"
        ).encode() + body

    async def send(self, worker: int, data: bytes) -> tuple[bytes, bytes]:
        conn = self.conns.get(worker)
        if conn is None or conn.transport is None or conn.transport.is_closing():
            _, conn = await asyncio.get_running_loop().create_connection(_Connection, self.host, self.port)
            self.conns[worker] = conn
        return await conn.request(data)

    def close(self) -> None:
        for conn in self.conns.values():
            if conn.transport is not None:
                conn.transport.close()
        self.conns.clear()


def header(head: bytes, name: bytes) -> bytes:
    """A header's value from a lower-cased response head."""
    at = head.find(b"\r\n" + name + b":")
    if at < 0:
        raise KeyError(name)
    end = head.find(b"\r\n", at + 2)
    return head[at + len(name) + 3 : end if end > 0 else None].strip()


async def run_load(n: int, concurrency: int, one) -> tuple[list[float], list[float], float]:
    """n calls of ``one(i, worker)`` (returns added-ms or None) on ``concurrency`` workers; latencies in ms."""
    lat: list[float] = []
    added: list[float] = []
    todo = iter(range(n))

    async def worker(w: int) -> None:
        for i in todo:
            t0 = time.perf_counter()
            a = await one(i, w)
            lat.append((time.perf_counter() - t0) * 1e3)
            if a is not None:
                added.append(a)

    start = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(concurrency)))
    return lat, added, n / (time.perf_counter() - start)


async def pod_stats(client, pod: str) -> dict | None:
    """The pod's engine counters (steps, seconds in step()); None for a pod without them (instant pod)."""
    async with client.get(pod + "/v1/stats") as r:
        return await r.json() if r.status == 200 else None


def add_steps(steps: dict, step_s: dict, side: str, before: dict | None, after: dict | None) -> None:
    if before and after and "steps" in before:
        steps[side] += after["steps"] - before["steps"]
        step_s[side] += after["step_s"] - before["step_s"]


def cpu_s(pid: int | None) -> float:
    if pid is None:
        return 0.0
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def run_delay_s(pid: int) -> float:
    """Seconds the process's threads have waited, runnable, for a CPU (Linux schedstat; 0 where not kept).

    On this shared box a burst of answers can sit in the gateway's socket while the pod and the load
    generator hold both cores: that wait counts as "added" latency but is no work of the gateway's."""
    total = 0
    for stat in Path(f"/proc/{pid}/task").glob("*/schedstat"):
        try:
            total += int(stat.read_text().split()[1])
        except (OSError, IndexError, ValueError):
            pass
    return total / 1e9


async def bench(pod: str, gw: str, model, args, pod_pid: int | None, gw_pids: list[int], owner: str) -> list[dict]:
    sp = {"max_tokens": args.max_tokens, "temperature": 1.0, "ignore_eos": True}
    auth = {"authorization": f"Bearer {RELAY_KEY}"} if args.relay else {}
    headers = {"content-type": "application/json", **auth}
    me = os.getpid()
    rows = []
    # Prompt numbers: every (round, side) gets its own, so neither side meets the other's prompts in the pod's
    # prefix cache; sessions i and j share a first turn when i // group_size == j // group_size (GRPO's n).
    next_prompt = iter(range(1 << 30))

    def prompts(n: int) -> list[int]:
        base = [next(next_prompt) for _ in range(-(-n // args.group_size))]
        return [base[i // args.group_size] for i in range(n)]

    # The timed requests go over RawClient (prepared requests on keep-alive connections, one per worker): both
    # sides do the same client work per request, one POST, read the whole answer. aiohttp does the rest.
    pod_raw, gw_raw = RawClient(pod), RawClient(gw)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=512)) as client:

        def direct(ks: list[int]):
            requests = [
                pod_raw.post(
                    "/v1/generate",
                    json.dumps(
                        {
                            "prompt_token_ids": model.encode(model.render(messages(k), None, True)),
                            "sampling_params": sp,
                        }
                    ).encode(),
                    headers,
                )
                for k in ks
            ]

            async def one(i: int, w: int):
                head, body = await pod_raw.send(w, requests[i])
                assert head.startswith(b"http/1.1 200"), (head, body[:300])
                return None

            return one

        async def open_sessions(n: int) -> list[str]:
            out = []
            for _ in range(n):
                async with client.post(
                    owner + "/v1/sessions", json={"sampling_params": {"ignore_eos": True}}, headers=auth
                ) as r:
                    out.append((await r.json())["session_id"])
            return out

        def via_gateway(sids: list[str], ks: list[int]):
            requests = [
                gw_raw.post(
                    f"/s/{sids[i]}/v1/chat/completions",
                    json.dumps({"model": "policy", "messages": messages(k), "max_tokens": args.max_tokens}).encode(),
                    headers,
                )
                for i, k in enumerate(ks)
            ]

            async def one(i: int, w: int):
                head, body = await gw_raw.send(w, requests[i])
                assert head.startswith(b"http/1.1 200"), (head, body[:300])
                timing = dict(p.strip().split(b";dur=") for p in header(head, b"server-timing").split(b","))
                return float(timing[b"gateway"])

            return one

        for c in args.concurrency:
            n = max(args.requests, 4 * c)
            await run_load(2 * c, c, direct(prompts(2 * c)))  # warm-up both paths
            await run_load(2 * c, c, via_gateway(await open_sessions(2 * c), prompts(2 * c)))
            d_lat, g_lat, g_added, d_rps, g_rps = [], [], [], [], []
            gw_wait = gw_cpu = pod_cpu_direct = pod_cpu_gw = client_direct = client_gw = 0.0
            steps = {"direct": 0.0, "gw": 0.0}
            step_s = {"direct": 0.0, "gw": 0.0}
            for _ in range(args.rounds):  # alternate so drift on a shared machine hits both paths alike
                one = direct(prompts(n))
                p0, m0, s0 = cpu_s(pod_pid), cpu_s(me), await pod_stats(client, pod)
                lat, _, rps = await run_load(n, c, one)
                pod_cpu_direct += cpu_s(pod_pid) - p0
                add_steps(steps, step_s, "direct", s0, await pod_stats(client, pod))
                client_direct += cpu_s(me) - m0
                d_lat += lat
                d_rps.append(rps)
                sids = await open_sessions(n)
                one = via_gateway(sids, prompts(n))
                p0, g0, m0, s0 = cpu_s(pod_pid), sum(map(cpu_s, gw_pids)), cpu_s(me), await pod_stats(client, pod)
                w0 = sum(map(run_delay_s, gw_pids))
                lat, added, rps = await run_load(n, c, one)
                pod_cpu_gw += cpu_s(pod_pid) - p0
                add_steps(steps, step_s, "gw", s0, await pod_stats(client, pod))
                gw_cpu += sum(map(cpu_s, gw_pids)) - g0
                gw_wait += sum(map(run_delay_s, gw_pids)) - w0
                client_gw += cpu_s(me) - m0
                g_lat += lat
                g_added += added
                g_rps.append(rps)
                async with client.post(
                    gw + "/v1/episodes",
                    headers=auth,
                    json={"episodes": [{"session_id": s, "reward": 0.0} for s in sids]},
                ) as r:
                    assert r.status == 200, await r.text()
            per_req = 1e3 / (n * args.rounds)
            rows.append(
                {
                    "concurrency": c,
                    "requests": n * args.rounds,
                    "group_size": args.group_size,
                    "direct_p50_ms": pct(d_lat, 0.5),
                    "direct_p99_ms": pct(d_lat, 0.99),
                    "gateway_p50_ms": pct(g_lat, 0.5),
                    "gateway_p99_ms": pct(g_lat, 0.99),
                    "added_p50_ms": pct(g_added, 0.5),
                    "added_p99_ms": pct(g_added, 0.99),
                    "direct_rps": statistics.median(d_rps),
                    "gateway_rps": statistics.median(g_rps),
                    "gateway_cpu_ms_per_req": gw_cpu * per_req,
                    "gateway_cpu_wait_ms_per_req": gw_wait * per_req,
                    "pod_cpu_ms_per_req_direct": pod_cpu_direct * per_req,
                    "pod_cpu_ms_per_req_via_gateway": pod_cpu_gw * per_req,
                    "client_cpu_ms_per_req_direct": client_direct * per_req,
                    "client_cpu_ms_per_req_via_gateway": client_gw * per_req,
                    "pod_steps_per_req_direct": steps["direct"] / (n * args.rounds),
                    "pod_steps_per_req_via_gateway": steps["gw"] / (n * args.rounds),
                    "pod_step_ms_direct": 1e3 * step_s["direct"] / max(steps["direct"], 1),
                    "pod_step_ms_via_gateway": 1e3 * step_s["gw"] / max(steps["gw"], 1),
                }
            )
            # Each gateway round against the direct round just before it: the machine's speed drifts by more than
            # the gateway's cost between rounds, and adjacent rounds drift least. The median of those pairs is
            # the ratio; the per-round figures show the spread.
            pairs = [g / d for d, g in zip(d_rps, g_rps)]
            rows[-1]["throughput_ratio"] = statistics.median(pairs)
            rows[-1]["throughput_ratio_per_round"] = [round(x, 3) for x in pairs]
    pod_raw.close()
    gw_raw.close()
    return rows


async def ttft(pod: str, gw: str, owner: str, model, args, auth: dict) -> dict:
    """Median seconds to the first token and to the end of a ``--ttft-tokens`` generation, direct and via the
    gateway (a session per request)."""
    sp = {"max_tokens": args.ttft_tokens, "temperature": 1.0, "ignore_eos": True}
    prompt = model.encode(model.render(messages(1 << 29), None, True))
    out: dict[str, list[float]] = {"direct_first": [], "direct_total": [], "gateway_first": [], "gateway_total": []}
    async with aiohttp.ClientSession() as client:
        for _ in range(args.ttft_requests):
            line = json.dumps({"id": "t", "prompt_token_ids": prompt, "sampling_params": sp, "stream": True})
            t0, first = time.perf_counter(), None
            async with client.post(pod + "/v1/generate_stream", data=line.encode() + b"\n") as r:
                async for raw in r.content:
                    if first is None and b'"delta"' in raw:
                        first = time.perf_counter() - t0
            out["direct_first"].append(first if first is not None else float("nan"))
            out["direct_total"].append(time.perf_counter() - t0)
            async with client.post(
                owner + "/v1/sessions", json={"sampling_params": {"ignore_eos": True}}, headers=auth
            ) as r:
                sid = (await r.json())["session_id"]
            body = {"model": "policy", "messages": messages(1 << 29), "max_tokens": args.ttft_tokens, "stream": True}
            t0, first = time.perf_counter(), None
            async with client.post(f"{gw}/s/{sid}/v1/chat/completions", json=body, headers=auth) as r:
                async for raw in r.content:
                    if first is None and raw.startswith(b"data: {"):
                        delta = json.loads(raw[6:])["choices"]
                        if delta and delta[0]["delta"].get("content"):
                            first = time.perf_counter() - t0
            out["gateway_first"].append(first if first is not None else float("nan"))
            out["gateway_total"].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in out.items()}


def table(rows: list[dict]) -> str:
    lines = [
        "| concurrency | direct p50 / p99 ms | gateway p50 / p99 ms | added p50 / p99 ms (target < 2 / < 10) "
        "| direct req/s | gateway req/s | ratio (target >= 0.90; median of per-round pairs) "
        "| gateway CPU ms/req (waiting for a CPU) "
        "| pod CPU ms/req direct / via gw | client CPU ms/req direct / via gw "
        "| pod steps/req (ms/step) direct / via gw |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['concurrency']} | {r['direct_p50_ms']:.2f} / {r['direct_p99_ms']:.2f} | "
            f"{r['gateway_p50_ms']:.2f} / {r['gateway_p99_ms']:.2f} | "
            f"{r['added_p50_ms']:.2f} / {r['added_p99_ms']:.2f} | {r['direct_rps']:.0f} | "
            f"{r['gateway_rps']:.0f} | {r['throughput_ratio']:.2f} | "
            f"{r['gateway_cpu_ms_per_req']:.2f} ({r['gateway_cpu_wait_ms_per_req']:.2f}) | "
            f"{r['pod_cpu_ms_per_req_direct']:.2f} / {r['pod_cpu_ms_per_req_via_gateway']:.2f} | "
            f"{r['client_cpu_ms_per_req_direct']:.2f} / {r['client_cpu_ms_per_req_via_gateway']:.2f} | "
            f"{r['pod_steps_per_req_direct']:.3f} ({r['pod_step_ms_direct']:.2f}) / "
            f"{r['pod_steps_per_req_via_gateway']:.3f} ({r['pod_step_ms_via_gateway']:.2f}) |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(ROOT / ".cache" / "models" / "tiny-qwen3"))
    p.add_argument("--pod-url", default=None, help="Use a running rollout pod instead of starting one.")
    p.add_argument("--requests", type=int, default=256, help="Requests per path per round.")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument(
        "--group-size",
        type=int,
        default=1,
        help="Sessions that share a first turn (GRPO's n samples per prompt); 1: every prompt differs, so "
        "the gateway's first-turn prompt cache never hits.",
    )
    p.add_argument(
        "--gateway-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="Extra gateway flag (repeat), e.g. --gateway-arg=--rollout.stream=false for one request per call.",
    )
    p.add_argument(
        "--pod-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="Extra rollout pod flag (repeat), e.g. --pod-arg=--rollout.idle_poll_ms=0.",
    )
    p.add_argument("--json", default=None, help="Also write the rows as JSON here.")
    p.add_argument(
        "--ttft-tokens",
        type=int,
        default=256,
        help="Tokens of the streamed generations that time the first token (0: skip that part).",
    )
    p.add_argument("--ttft-requests", type=int, default=3, help="Streamed generations per path for the first token.")
    p.add_argument(
        "--instant-pod",
        action="store_true",
        help="Use a model-free pod that answers at once: measures what the gateway alone can carry.",
    )
    p.add_argument(
        "--relay",
        action="store_true",
        help="Two gateway replicas: sessions open on one, every turn is sent to the other, which forwards "
        "it (what a Service does to a client without affinity). Added latency is what both add; "
        "gateway CPU is both processes'.",
    )
    p.add_argument(
        "--pin",
        action="store_true",
        help="Pin the pod to the last CPU and the gateway + load generator to the others, so the pod's "
        "compute is not shared with the gateway (as when the pod has its own GPU node).",
    )
    args = p.parse_args()
    if not (Path(args.model) / "config.json").exists():
        from molt.models.tiny import build_tiny

        build_tiny(args.model)
    logs = Path(tempfile.mkdtemp(prefix="bench-gateway-"))
    procs = []
    pod_prefix = gw_prefix = None
    if args.pin:
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) < 2:
            raise SystemExit("--pin needs at least 2 CPUs")
        rest = ",".join(map(str, cpus[:-1]))
        pod_prefix, gw_prefix = ["taskset", "-c", str(cpus[-1])], ["taskset", "-c", rest]
        os.sched_setaffinity(0, set(cpus[:-1]))
    try:
        pod, pod_pid = args.pod_url, None
        if pod is None and args.instant_pod:
            proc, pod = start_instant_pod(logs / "pod.log", prefix=pod_prefix)
            procs.append(proc)
            pod_pid = proc.pid
        elif pod is None:
            proc, pod = start_rollout_pod(args.model, logs / "pod.log", prefix=pod_prefix, extra=args.pod_arg)
            procs.append(proc)
            pod_pid = proc.pid
        gateways = []
        for name in ("owner", "relay") if args.relay else ("gateway",):
            extra = []
            if args.relay:
                port = free_port()
                extra = [
                    "--server.port",
                    str(port),
                    "--replica.public_url",
                    f"http://127.0.0.1:{port}",
                    "--auth.api_keys",
                    RELAY_KEY,
                ]
            proc, url = start_gateway(
                [
                    "--model",
                    args.model,
                    "--rollout.urls",
                    pod,
                    "--redis.url",
                    "memory://",
                    "--session.max_length",
                    "1024",
                    *extra,
                    *args.gateway_arg,
                ],
                logs / f"{name}.log",
                prefix=gw_prefix,
            )
            procs.append(proc)
            gateways.append((proc.pid, url))
        model = ChatModel(args.model)
        gc.collect()
        gc.freeze()  # keep full collections of the torch/transformers import graph off the timed path
        rows = uvloop.run(
            bench(pod, gateways[-1][1], model, args, pod_pid, [pid for pid, _ in gateways], gateways[0][1])
        )
        first = None
        if args.ttft_tokens and args.ttft_requests:
            auth = {"authorization": f"Bearer {RELAY_KEY}"} if args.relay else {}
            first = uvloop.run(ttft(pod, gateways[-1][1], gateways[0][1], model, args, auth))
    finally:
        for proc in reversed(procs):
            stop(proc)
    print(
        f"# gateway vs direct, {args.max_tokens} generated tokens per request, group size {args.group_size}, "
        f"{os.cpu_count()} CPUs, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} at the end, "
        f"{'pod pinned to its own CPU' if args.pin else 'unpinned'}, "
        f"{'instant model-free pod' if args.instant_pod else 'vLLM pod on ' + Path(args.model).name}, "
        f"{'every turn relayed by a second replica, ' if args.relay else ''}"
        f"{'pod flags ' + ' '.join(args.pod_arg) + ', ' if args.pod_arg else ''}"
        f"{'gateway flags ' + ' '.join(args.gateway_arg) + ', ' if args.gateway_arg else ''}logs {logs}"
    )
    print(table(rows))
    for r in rows:
        print(f"concurrency {r['concurrency']}: gateway / direct req/s per round: {r['throughput_ratio_per_round']}")
    if first is not None:
        print(f"\n# time to first token, {args.ttft_tokens} tokens streamed, median of {args.ttft_requests}")
        print("| path | first token ms | whole generation ms | first / whole |\n|---|---|---|---|")
        for side in ("direct", "gateway"):
            print(
                f"| {side} | {1e3 * first[side + '_first']:.1f} | {1e3 * first[side + '_total']:.1f} | "
                f"{first[side + '_first'] / first[side + '_total']:.3f} |"
            )
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "ttft": first}, indent=2))


if __name__ == "__main__":
    main()
