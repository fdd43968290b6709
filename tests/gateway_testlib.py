"""Test and benchmark helpers: an in-memory fake pod fleet (a PodTransport) and process launchers.

``FakePods`` (a ``PodTransport``) answers ``/v1/generate`` like a rollout pod, from a script, so unit
tests can drive exact model outputs (tool calls, stop reasons) without a model. The launchers start real services as
subprocesses (``molt.serve.start_service``: the URL from the line each prints when it binds, then /readyz).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import redis

from molt.net import LineSplitter
from molt.serve import start_service
from services.gateway.transport import PodConnectionError, PodTransport

Script = Callable[[list[int], dict], list[int]]


def fake_logprob(token_id: int, position: int) -> float:
    return -0.01 - ((token_id * 7 + position * 13) % 97) / 50.0


def fake_top_logprobs(token_id: int, position: int, k: int) -> list[list]:
    """A fake pod's ``k`` best ``[id, logprob]`` at ``position``, best first: the sampled token first (with its
    ``fake_logprob``), then others; one short at every fourth position, as a pod leaves out tokens the sampling
    settings rule out."""
    own = fake_logprob(token_id, position)
    m = k - 1 if position % 4 == 3 else k
    return [[token_id if j == 0 else 1000 + (token_id * 31 + j) % 5000, own - 0.25 * j] for j in range(m)]


@dataclass
class FakePod:
    script: Script
    version: int = 0
    down: bool = False
    vocab: str = ""
    """The vocabulary fingerprint its /readyz reports ("": none)."""
    max_logprobs: int | None = None
    """The bound on top_logprobs its /readyz reports (None: none)."""
    calls: list[tuple[list[int], dict]] = field(default_factory=list)
    images: list[list | None] = field(default_factory=list)
    """Each call's ``images`` (None: the request had none)."""


class FakePods(PodTransport):
    """Fake rollout pods keyed by base URL; ``down`` pods refuse connections."""

    def __init__(self, urls: list[str], script: Script) -> None:
        self.pods = {u: FakePod(script) for u in urls}
        self.top_logprobs = False
        """Answer a call's ``top_logprobs`` with ``fake_top_logprobs`` rows; off: none, as a pod that ignores it."""

    def _pod(self, url: str) -> tuple[FakePod, str]:
        base, _, path = url.partition("://")[2].partition("/")
        pod = self.pods[url.split("://")[0] + "://" + base]
        if pod.down:
            raise PodConnectionError("connection refused (fake pod is down)")
        return pod, "/" + path

    async def get(self, url: str, timeout_s: float) -> tuple[int, bytes]:
        pod, _ = self._pod(url)
        bound = {} if pod.max_logprobs is None else {"max_logprobs": pod.max_logprobs}
        return 200, json.dumps({"ready": True, "vocab": pod.vocab, **bound}).encode()

    async def post_json(self, url: str, body: bytes) -> tuple[int, bytes, float]:
        pod, _ = self._pod(url)
        req = json.loads(body)
        prompt, sp = req["prompt_token_ids"], req.get("sampling_params", {})
        pod.calls.append((list(prompt), dict(sp)))
        pod.images.append(req.get("images"))
        outputs = []
        for _ in range(sp.get("n", 1)):
            ids = list(pod.script(prompt, sp))
            max_tokens = sp.get("max_tokens", 16)
            finish = "stop"
            if len(ids) > max_tokens:
                ids, finish = ids[:max_tokens], "length"
            outputs.append(
                {
                    "token_ids": ids,
                    "logprobs": [fake_logprob(t, i) for i, t in enumerate(ids)],
                    "finish_reason": finish,
                    "policy_version": pod.version,
                }
            )
            if self.top_logprobs and sp.get("top_logprobs"):
                outputs[-1]["top_logprobs"] = [fake_top_logprobs(t, i, sp["top_logprobs"]) for i, t in enumerate(ids)]
        answer: dict = {"outputs": outputs, "policy_version": pod.version}
        if req.get("images"):  # a real pod answers with the prompt as its processor expanded it
            answer["prompt_token_ids"] = list(prompt)
        return 200, json.dumps(answer).encode(), time.perf_counter()


class StepChannel:
    """A FakePods pod behind a generate stream (PodChannel's ``generate``): a streamed call's tokens reach the
    gateway one engine step (``step_s``) at a time, then the answer, so unit tests see a turn as it streams."""

    def __init__(self, pods: FakePods, url: str, step_s: float = 0.002) -> None:
        self.pods, self.url, self.step_s = pods, url, step_s

    async def generate(self, body: bytes, on_tokens: Callable[[list[int], list[float]], None] | None = None) -> tuple:
        import asyncio

        start = time.perf_counter()
        status, answer, _ = await self.pods.post_json(self.url + "/v1/generate", body)
        data = json.loads(answer)
        if on_tokens is not None and status == 200:
            out = data["outputs"][0]
            for tok, lp in zip(out["token_ids"], out["logprobs"]):
                await asyncio.sleep(self.step_s)
                on_tokens([tok], [lp])
        return status, data, start, time.perf_counter()

    def close(self) -> None:
        pass


def stream_steps(app, fake: FakePods, step_s: float = 0.002) -> None:
    """Puts every pod of ``app`` (a scripted_gateway) behind a ``StepChannel``: its streamed turns stream."""
    for url, pod in app.gateway.pool.pods.items():
        pod.channel = StepChannel(fake, url, step_s)


def scripted_gateway(model, script: Script, pods: list[str], **sections: dict) -> tuple:
    """The gateway app in this process on ``model`` (a ChatModel), its ``pods`` a FakePods answering from
    ``script``, trajectories in memory; ``sections`` are settings sections over those (e.g. ``session={...}``).
    (app, the FakePods, an httpx client over ASGI, no lifespan run; its ``anthropic`` attribute is an httpx2
    client of the same app, as the anthropic SDK takes)."""
    import httpx
    import httpx2

    from services.gateway.app import build_app
    from services.gateway.config import GatewaySettings

    cfg: dict = {
        "model": {"path": str(model.path)},
        "rollout": {"urls": pods},
        "redis": {"url": "memory://", "stream": "test"},
    }
    for name, values in sections.items():
        cfg[name] = {**cfg.get(name, {}), **values}
    fake = FakePods(pods, script)
    app = build_app(GatewaySettings.model_validate(cfg), transport=fake, model=model)
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw")
    http.anthropic = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://gw")
    return app, fake, http


def queued_gateway(model, pods: list[str], **sections: dict) -> tuple:
    """``scripted_gateway`` whose pod answers the next text a test puts in the queue (then "Done."):
    (app, the FakePods, the queue, an httpx client over ASGI). ``sections``: as scripted_gateway's."""
    queue: list[str] = []
    app, fake, http = scripted_gateway(
        model, lambda prompt, sp: model.encode(queue.pop(0) if queue else "Done.<|im_end|>"), pods, **sections
    )
    return app, fake, queue, http


def thinking_switch_model(src: Path, dest: Path):
    """A copy of the tiny model (``src``) whose generation prompt holds an empty think block when
    ``enable_thinking`` is false, as Qwen3's does; its ChatModel."""
    import shutil

    from services.gateway.chat import ChatModel

    shutil.copytree(src, dest)
    tpl = (dest / "chat_template.jinja").read_text()
    assert tpl.endswith("{{ '<|im_start|>assistant' + nl }}{%- endif -%}")
    switch = (
        "{%- if enable_thinking is defined and enable_thinking is false -%}"
        "{{ '<think>' + nl + nl + '</think>' + nl + nl }}{%- endif -%}"
    )
    (dest / "chat_template.jinja").write_text(tpl[: -len("{%- endif -%}")] + switch + "{%- endif -%}")
    return ChatModel(dest)


def thinking_model(src: Path, dest: Path, opens_block: bool = False):
    """A copy of the tiny model (``src``) whose template renders an assistant's ``reasoning_content`` as a think
    block (as Qwen3's does); ``opens_block``: its generation prompt also opens the block (``<think>\\n`` after the
    assistant header, as Qwen3-Thinking-2507's, DeepSeek-R1 distills' and QwQ's), so a reply holds only the
    block's end. Its ChatModel."""
    import shutil

    from services.gateway.chat import ChatModel

    shutil.copytree(src, dest)
    tpl = (dest / "chat_template.jinja").read_text()
    old = "'<|im_start|>assistant' + nl + (message.content or '')"
    block = "('<think>' + nl + message.reasoning_content + nl + '</think>' + nl + nl"
    block += " if message.reasoning_content else '')"
    assert old in tpl and tpl.endswith("{{ '<|im_start|>assistant' + nl }}{%- endif -%}")
    tpl = tpl.replace(old, f"'<|im_start|>assistant' + nl + {block} + (message.content or '')")
    if opens_block:
        tpl = tpl[: -len(" }}{%- endif -%}")] + " + '<think>' + nl }}{%- endif -%}"
    (dest / "chat_template.jinja").write_text(tpl)
    return ChatModel(dest)


def read_trajectories(redis_url: str, stream: str) -> list:
    """Every trajectory entry on ``stream`` (repeats included), read through a consumer group of its own."""
    import asyncio

    from molt.bus.redis_stream import RedisTrajectoryQueue

    async def go() -> list:
        q = RedisTrajectoryQueue(redis_url, stream, group="check")
        try:
            found = []
            for _ in range(3):
                found += [d.trajectory for d in await q.read("c", 100, block_s=0.2)]
            return found
        finally:
            await q.close()

    return asyncio.run(go())


# ---- real processes


ROOT = Path(__file__).resolve().parents[1]


class ReplicaGroup:
    """Gateway replicas in this process on one real Redis stream, each with its own fake pod at ``pod`` and an
    httpx client over ASGI (no lifespan runs: tests call the core's loops and ``shut_down`` themselves).
    ``close()`` deletes the stream's keys and closes the replicas' queues."""

    def __init__(self, model, redis_url: str, stream: str, pod: str) -> None:
        self.model, self.redis_url, self.stream, self.pod = model, redis_url, stream, pod
        self.apps: list = []

    def add(self, script: Script, **sections: dict) -> tuple:
        """A replica: ``sections`` are settings sections over the group's (e.g. ``auth={...}``).
        (app, httpx client, its FakePods)."""
        redis = {"url": self.redis_url, "stream": self.stream, **sections.pop("redis", {})}
        app, pods, http = scripted_gateway(self.model, script, [self.pod], redis=redis, **sections)
        self.apps.append(app)
        return app, http, pods

    async def close(self) -> None:
        import redis.asyncio as aioredis

        r = aioredis.from_url(self.redis_url)
        try:
            keys = [k async for k in r.scan_iter(match=f"{self.stream}*")]
            if keys:
                await r.delete(*keys)
        finally:
            await r.aclose()
        for app in self.apps:
            await app.gateway.queue.close()


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def start_rollout_pods(
    model_dir: str | Path,
    log_paths: list[Path],
    max_model_len: int = 1024,
    extra: list[str] | None = None,
    timeout_s: float = 180.0,
    prefix: list[str] | None = None,
) -> list[tuple[subprocess.Popen, str]]:
    """Real rollout pods (tiny-model settings for CPU), started in parallel; ``prefix`` wraps the command."""
    cmd = [
        *(prefix or []),
        sys.executable,
        "-m",
        "services.rollout",
        "--model.path",
        str(model_dir),
        "--server.port",
        "0",
        "--vllm.dtype",
        "float32",
        "--vllm.enforce_eager",
        "--vllm.max_model_len",
        str(max_model_len),
        "--vllm.kv_cache_memory_bytes",
        str(64 << 20),
        "--server.log_level",
        "warning",
        *(extra or []),
    ]
    with ThreadPoolExecutor(len(log_paths)) as pool:  # in parallel: each loads its own engine
        started = [
            pool.submit(start_service, cmd, log_path=log_path, env=_env(), cwd=ROOT, timeout_s=timeout_s)
            for log_path in log_paths
        ]
    failed = [f.exception() for f in started if f.exception() is not None]
    if failed:
        for f in started:
            if f.exception() is None:
                stop(f.result()[0])
        raise failed[0]
    return [f.result() for f in started]


def start_rollout_pod(model_dir: str | Path, log_path: Path, **kwargs) -> tuple[subprocess.Popen, str]:
    return start_rollout_pods(model_dir, [log_path], **kwargs)[0]


def start_gateway(
    args: list[str], log_path: Path, timeout_s: float = 60.0, prefix: list[str] | None = None
) -> tuple[subprocess.Popen, str]:
    cmd = [
        *(prefix or []),
        sys.executable,
        "-m",
        "services.gateway",
        "--server.port",
        "0",
        "--server.log_level",
        "warning",
        *args,
    ]
    return start_service(cmd, log_path=log_path, env=_env(), cwd=ROOT, timeout_s=timeout_s)


def stop(proc: subprocess.Popen, timeout_s: float = 15.0) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def pod_and_gateway(
    model_dir: str | Path,
    logs: Path,
    redis_url: str,
    name: str,
    max_length: int = 1024,
    pod: dict | None = None,
    gateway: list[str] | None = None,
) -> Iterator[tuple[str, str, str]]:
    """A real rollout pod (``pod``: start_rollout_pod's keywords) and a gateway in front of it (``gateway``: more
    flags) capturing into a stream of its own, ``molt:test:{name}:<random>``. Yields (gateway url, pod url,
    stream); stops both and deletes the stream's keys on the way out."""
    stream = f"molt:test:{name}:{uuid.uuid4().hex[:8]}"
    pod_proc, pod_url = start_rollout_pod(model_dir, logs / "pod.log", **(pod or {}))
    gw = None
    try:
        args = ["--model", str(model_dir), "--rollout.urls", pod_url, "--redis.url", redis_url]
        args += ["--redis.stream", stream, "--session.max_length", str(max_length), *(gateway or [])]
        gw, url = start_gateway(args, logs / "gateway.log")
        yield url, pod_url, stream
    finally:
        if gw is not None:
            stop(gw)
        stop(pod_proc)
        if not redis_url.startswith("memory://"):
            r = redis.Redis.from_url(redis_url)
            r.delete(stream, f"{stream}:dead", *r.scan_iter(match=f"{stream}:consumed:check:*"))
            r.close()


# ---- an instant pod, to measure the gateway alone (bench/gateway.py --instant-pod)

_INSTANT = json.dumps(
    {
        "policy_version": 0,
        "outputs": [
            {
                "token_ids": [100, 200, 300, 2],
                "logprobs": [-0.1, -0.2, -0.3, -0.4],
                "finish_reason": "stop",
                "policy_version": 0,
            }
        ],
    }
).encode()


async def _instant_pod(scope, receive, send) -> None:
    """Raw ASGI app answering /v1/generate (and each call of /v1/generate_stream) at once with 4 fixed tokens
    (no model): the cheapest pod."""
    if scope["type"] == "lifespan":
        while True:
            msg = await receive()
            done = "lifespan.startup.complete" if msg["type"] == "lifespan.startup" else "lifespan.shutdown.complete"
            await send({"type": done})
            if done == "lifespan.shutdown.complete":
                return
    if scope["path"] == "/v1/generate_stream":  # one answer line per call line, at once
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/x-ndjson")]}
        )
        lines = LineSplitter()
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            answers = [
                b'{"id":%s,"status":200,%s\n' % (json.dumps(json.loads(line)["id"]).encode(), _INSTANT[1:])
                for line in lines.feed(msg.get("body", b""))
                if b'"abort"' not in line[:10]
            ]
            if answers or not msg.get("more_body"):
                await send(
                    {"type": "http.response.body", "body": b"".join(answers), "more_body": bool(msg.get("more_body"))}
                )
            if not msg.get("more_body"):
                return
    while (await receive()).get("more_body"):
        pass
    body = _INSTANT if scope["path"] == "/v1/generate" else b"{}"
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": body})


def start_instant_pod(log_path: Path, prefix: list[str] | None = None) -> tuple[subprocess.Popen, str]:
    cmd = [*(prefix or []), sys.executable, "-m", "tests.gateway_testlib", "instant-pod"]
    return start_service(cmd, log_path=log_path, env=_env(), cwd=ROOT, timeout_s=30)


if __name__ == "__main__" and sys.argv[1:] == ["instant-pod"]:
    from molt.config import ServerConfig
    from molt.serve import serve

    serve("instant-pod", _instant_pod, ServerConfig(log_level="warning"))


@contextlib.contextmanager
def file_server(answer: Callable[[str], tuple[int, dict[str, str], bytes]]):
    """A loopback HTTP server (a thread) whose GETs ``answer(path)`` gives as (status, headers, body); yields its
    base URL. A client that gives up before the answer is written is ignored."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            status, headers, body = answer(self.path)
            try:
                self.send_response(status)
                for k, v in {"content-length": str(len(body)), **headers}.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(body)
            except (BrokenPipeError, ConnectionResetError):
                pass

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
