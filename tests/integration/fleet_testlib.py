"""A stand-in rollout fleet for trainer fault tests (no tests here): pods with the real weight-sync gRPC server
over a recording engine, and a real HTTP env worker that writes synthetic rollouts stamped with the version of
a ready pod (as the gateway would route: never to a pod that is not ready)."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import threading
import time

import numpy as np
import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from molt.bus.redis_stream import RedisTrajectoryQueue
from molt.schema import Segment, Trajectory
from molt.weightsync.server import start_weightsync_server
from services.rollout.checkpoint import expected_parameters


class Pod:
    """The engine side of a pod. ``awaiting``: not ready until a push (``--weights.await_push``);
    ``kill_during_push`` = (version, pid) SIGKILLs the pusher inside that version's commit."""

    def __init__(self, model_dir, awaiting: bool = False) -> None:
        self.spec = expected_parameters(model_dir)
        self.serving_dtype = ""
        self.policy_version = 0
        self.awaiting = awaiting
        self.applied: list[int] = []
        self.kill_during_push: tuple[int, int] | None = None
        self.killed_in_push = threading.Event()

    @property
    def ready(self) -> bool:
        return not self.awaiting

    def expected_parameters(self):
        return dict(self.spec)

    async def apply_weights(self, tensors, version, keep, replace=False):
        if self.kill_during_push and self.kill_during_push[0] == version:
            os.kill(self.kill_during_push[1], signal.SIGKILL)
            self.kill_during_push = None
            self.killed_in_push.set()
        self.policy_version = version
        self.awaiting = False
        self.applied.append(version)
        return {"untouched": []}

    async def prompt_logprobs(self, token_ids):
        return []


class Fleet:
    """Pods (weight-sync servers) and one env worker, served from a loop thread of their own."""

    def __init__(self, model_dir, redis_url: str, stream: str, num_pods: int = 1) -> None:
        self.model_dir, self.redis_url, self.stream = model_dir, redis_url, stream
        self.written: dict[str, tuple[str, int, str]] = {}  # trajectory id -> (group id, sample, prompt)
        self.paused = False  # episodes wait (the trainer runs out of rollouts)
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.pods: list[Pod] = []
        self.servers, self.grpc_ports = [], []
        self.pod_servers: list = []  # (uvicorn server, its serving future) of serve_pod_http
        for _ in range(num_pods):
            pod = Pod(model_dir)
            server, port = self._call(start_weightsync_server(pod, "127.0.0.1", 0))
            self.pods.append(pod)
            self.servers.append(server)
            self.grpc_ports.append(port)
        self.server = uvicorn.Server(uvicorn.Config(self._app(), host="127.0.0.1", port=0, log_level="warning"))
        self.serving = asyncio.run_coroutine_threadsafe(self.server.serve(), self.loop)
        while not self.server.started:
            time.sleep(0.01)
        self.url = f"http://127.0.0.1:{self.server.servers[0].sockets[0].getsockname()[1]}"

    def _call(self, coro, timeout_s: float = 30):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    @property
    def grpc_targets(self) -> list[str]:
        return [f"127.0.0.1:{p}" for p in self.grpc_ports]

    def restart_pod(self, i: int) -> Pod:
        """Stop pod ``i`` and start it again on the same port, on base weights (version 0), awaiting a push."""
        self._call(self.servers[i].stop(0))
        pod = Pod(self.model_dir, awaiting=True)
        self.servers[i], port = self._call(start_weightsync_server(pod, "127.0.0.1", self.grpc_ports[i]))
        assert port == self.grpc_ports[i]
        self.pods[i] = pod
        return pod

    def serve_pod_http(self, i: int, port: int) -> None:
        """Pod ``i``'s /readyz on ``port``, as a real pod answers it once its engine is loaded (200 or, awaiting
        a push, 503; with its ``grpc_port``), for trainers that find the weight-sync port through --rollout.urls."""
        app = FastAPI()

        @app.get("/readyz")
        async def readyz():
            pod = self.pods[i]
            body = {"ready": pod.ready, "policy_version": pod.policy_version, "grpc_port": self.grpc_ports[i]}
            return JSONResponse(body, 200 if pod.ready else 503)

        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self.pod_servers.append((server, asyncio.run_coroutine_threadsafe(server.serve(), self.loop)))
        while not server.started:
            time.sleep(0.01)

    def _app(self) -> FastAPI:
        app = FastAPI()
        queue = RedisTrajectoryQueue(self.redis_url, self.stream)

        @app.post("/v1/episodes:run")
        async def run(body: dict):
            await asyncio.sleep(random.uniform(0.0, 0.05))
            while self.paused:
                await asyncio.sleep(0.05)
            ready = [p for p in self.pods if p.ready]
            if not ready:  # what the gateway answers when no pod is ready
                return JSONResponse({"error": {"message": "no ready rollout pod"}}, 503, headers={"Retry-After": "1"})
            version = random.choice(ready).policy_version
            rng = np.random.default_rng(len(self.written))
            seg = Segment(rng.integers(3, 1000, 10), [[4, 10]], -np.ones(6), np.full(6, version))
            tid = Trajectory.new_id()
            prompt = body["prompt"] if isinstance(body["prompt"], str) else body["prompt"][-1]["content"]
            self.written[tid] = (body["group_id"], body["sample_index"], prompt)
            await queue.put(
                Trajectory(tid, body["group_id"], body["sample_index"], [seg], float(body["sample_index"] % 2))
            )
            return {
                "status": "ok",
                "reward": 0.0,
                "score": None,
                "turns": 1,
                "tokens": 6,
                "trajectory_id": tid,
                "written": True,
            }

        return app

    def close(self) -> None:
        for server, serving in [(self.server, self.serving), *self.pod_servers]:
            server.should_exit = True
            serving.result(30)
        for server in self.servers:
            self._call(server.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)
