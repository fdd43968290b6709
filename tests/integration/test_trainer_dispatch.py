"""Dispatch mode end to end over real HTTP and Redis: the controller reads a JSONL dataset, sends
n episodes per prompt to two env-worker replicas (one answers 429 at first, episodes sometimes fail
and are retried), assembles the groups from the stream, trains, and never dispatches more than
--train.async_queue_size versions ahead of the trainer.

The env workers here are small real HTTP servers that write synthetic trajectories straight to the
stream (standing in for env + gateway + rollout pod, which have their own tests)."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import numpy as np
import torch.distributed as dist
import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from molt.bus.redis_stream import RedisTrajectoryQueue
from molt.config import parse_settings
from molt.schema import Segment, Trajectory
from services.trainer.checks import validate_settings
from services.trainer.config import TrainerSettings
from services.trainer.model import init_distributed
from services.trainer.publish import CallbackPublisher
from services.trainer.trainer import Trainer
from tests.integration.trainer_testlib import dispatch_flags


class Workers:
    def __init__(self, redis_url, stream):
        self.redis_url, self.stream = redis_url, stream
        self.version = 0
        self.calls: list[tuple[str, int, int]] = []  # (group_id, sample_index, trainer version at dispatch)
        self.throttled_once = False
        self.failed_once: set[str] = set()
        self.ids: list[str] = []
        self.servers, self.urls = [], []

    def app(self, name):
        app = FastAPI()
        queue = {}

        @app.post("/v1/episodes:run")
        async def run(body: dict):
            if name == "w0" and not self.throttled_once:
                self.throttled_once = True
                return JSONResponse({"error": {"message": "saturated"}}, 429, headers={"Retry-After": "0.05"})
            key = f"{body['group_id']}/{body['sample_index']}"
            self.calls.append((body["group_id"], body["sample_index"], self.version))
            if body["sample_index"] == 1 and key not in self.failed_once:
                self.failed_once.add(key)  # first try of every second sample fails without writing
                return {"status": "failed", "written": False, "error": "env crashed", "reward": 0.0}
            if "q" not in queue:
                queue["q"] = RedisTrajectoryQueue(self.redis_url, self.stream)
            rng = np.random.default_rng(len(self.calls))
            tokens = rng.integers(3, 1000, 10)
            tid = Trajectory.new_id()
            self.ids.append(tid)
            seg = Segment(tokens, [[4, 10]], -np.ones(6), np.full(6, self.version))
            await queue["q"].put(
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

    def start(self):
        for name in ("w0", "w1"):
            server = uvicorn.Server(uvicorn.Config(self.app(name), host="127.0.0.1", port=0, log_level="warning"))
            thread = threading.Thread(target=server.run, daemon=True)
            thread.start()
            while not server.started:
                time.sleep(0.01)
            self.servers.append((server, thread))
            self.urls.append(f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}")

    def stop(self):
        for server, thread in self.servers:
            server.should_exit = True
            thread.join(timeout=10)


def test_dispatch_trains_every_group_and_respects_the_staleness_bound(tiny_qwen3, redis_url, stream_name, tmp_path):
    workers = Workers(redis_url, stream_name)
    workers.start()
    audit = tmp_path / "audit.jsonl"
    s = parse_settings(
        TrainerSettings,
        [
            *dispatch_flags(tmp_path, 6, tiny_qwen3, redis_url, stream_name, *workers.urls),
            "--envs.max_retries",
            "2",
            "--envs.retry_backoff_s",
            "0.05",
            "--algo.advantage.estimator",
            "grpo",
            "--algo.kl.init_coef",
            "0",
            "--rollout.n_samples_per_prompt",
            "2",
            "--rollout.batch_size",
            "2",
            "--train.batch_size",
            "4",
            "--fsdp.strategy",
            "torch",
            "--logger.steps_jsonl",
            str(audit),
            "--ckpt.path",  # its final model goes next to it, not into the working directory
            str(tmp_path / "ckpt" / "checkpoints"),
        ],
        environ={},
    )
    validate_settings(s)

    def publish(version, tensors):
        workers.version = version

    info = init_distributed()
    trainer = Trainer(s, info, publisher=CallbackPublisher(publish))
    try:
        summary = trainer.run()
    finally:
        trainer.close()
        dist.destroy_process_group()
        workers.stop()

        async def cleanup():
            q = RedisTrajectoryQueue(redis_url, stream_name)
            await q.delete()
            await q.close()

        asyncio.run(cleanup())
    assert summary["steps"] == 3  # 6 prompts / 2 groups per step, then the dataset is exhausted
    entries = [json.loads(line) for line in audit.read_text().splitlines()]
    trained = [i for e in entries for i in e["trajectory_ids"]]
    assert sorted(trained) == sorted(workers.ids) and len(trained) == 12
    assert workers.throttled_once and len(workers.failed_once) == 6  # every failed episode was retried
    groups = sorted({g for g, _, _ in workers.calls}, key=lambda g: int(g.rsplit("-", 1)[1]))
    assert len(groups) == 6
    for group_id, _, version in workers.calls:  # --train.async_queue_size 1: batch k needs version >= k - 1
        batch = int(group_id.rsplit("-", 1)[1]) // 2
        assert version >= batch - 1, (group_id, version)
