"""A stand-in env worker process for the trainer's outage tests: ``POST /v1/episodes:run`` writes one synthetic
rollout to the stream, first appending ``{trajectory_id, group_id, sample_index, prompt}`` to a JSONL record file
(so the file may also hold episodes that never reached the stream).
While the stream is unreachable it answers 503 with Retry-After (nothing reaches the stream).

argv: port redis_url stream records_path [die_after]. With ``die_after`` the process SIGKILLs itself once it has
written that many episodes, so a test's worker outage always leaves prompts unwritten however fast the trainer is.
"""

import asyncio
import json
import os
import signal
import sys

import numpy as np
import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from molt.bus.redis_stream import RedisTrajectoryQueue
from molt.schema import Segment, Trajectory


def build(redis_url: str, stream: str, records: str, die_after: int | None = None) -> FastAPI:
    app = FastAPI()
    queue = RedisTrajectoryQueue(redis_url, stream)
    rng = np.random.default_rng(0)
    written = 0

    @app.post("/v1/episodes:run")
    async def run(body: dict):
        nonlocal written
        await asyncio.sleep(0.02)
        seg = Segment(rng.integers(3, 1000, 10), [[4, 10]], -np.ones(6), np.zeros(6))
        traj = Trajectory(
            Trajectory.new_id(), body["group_id"], body["sample_index"], [seg], float(body["sample_index"] % 2)
        )
        # The record goes down before the stream write: a concurrent request may SIGKILL the process while this
        # one waits on the put, and a trajectory in the stream must never be missing from the record file.
        prompt = body["prompt"] if isinstance(body["prompt"], str) else body["prompt"][-1]["content"]
        with open(records, "a") as f:
            f.write(
                json.dumps(
                    {
                        "trajectory_id": traj.trajectory_id,
                        "group_id": traj.group_id,
                        "sample_index": traj.sample_index,
                        "prompt": prompt,
                    }
                )
                + "\n"
            )
        try:
            await queue.put(traj)
        except queue.transient_errors as exc:
            return JSONResponse(
                {"error": {"message": f"stream unavailable: {exc}"}}, 503, headers={"Retry-After": "1"}
            )
        written += 1
        if die_after is not None and written >= die_after:
            os.kill(os.getpid(), signal.SIGKILL)
        return {
            "status": "ok",
            "reward": 0.0,
            "score": None,
            "turns": 1,
            "tokens": 6,
            "trajectory_id": traj.trajectory_id,
            "written": True,
        }

    return app


if __name__ == "__main__":
    port, redis_url, stream, records = int(sys.argv[1]), *sys.argv[2:5]
    die_after = int(sys.argv[5]) if len(sys.argv) > 5 else None
    uvicorn.run(build(redis_url, stream, records, die_after), host="127.0.0.1", port=port, log_level="warning")
