"""Helpers of the env-worker integration tests: serve real apps on loopback ports, read the stream back."""

from __future__ import annotations

import threading
import time

import uvicorn


class Served:
    """An ASGI app served by uvicorn on 127.0.0.1:<kernel-picked port>, in a thread with its own loop."""

    def __init__(self, app, name: str, start_timeout_s: float = 180.0) -> None:
        self.server = uvicorn.Server(
            uvicorn.Config(
                app, host="127.0.0.1", port=0, log_level="warning", lifespan="on", timeout_graceful_shutdown=5
            )
        )
        self.thread = threading.Thread(target=self.server.run, name=name, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + start_timeout_s
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError(f"{name} failed to start (see the log above)")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} did not start within {start_timeout_s} s")
            time.sleep(0.05)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


class StreamReader:
    """Reads the trajectory stream through the bus (decoding and validating each record) and keeps all."""

    def __init__(self, redis_url: str, stream: str) -> None:
        from molt.bus.redis_stream import RedisTrajectoryQueue

        self.queue = RedisTrajectoryQueue(redis_url, stream, group="envs-test-reader")
        self.seen: dict = {}

    async def drain(self, block_s: float = 0.2) -> dict:
        while batch := await self.queue.read("reader", 256, block_s=block_s):
            for d in batch:
                self.seen[d.trajectory.trajectory_id] = d.trajectory
        return self.seen

    async def get(self, ids: set[str], timeout_s: float = 10.0) -> dict:
        """trajectory_id -> Trajectory for every id in ``ids`` (waits until all arrived)."""
        deadline = time.monotonic() + timeout_s
        while not ids <= set(self.seen):
            if time.monotonic() > deadline:
                raise TimeoutError(f"trajectories {sorted(ids - set(self.seen))} never reached the stream")
            await self.drain()
        return {i: self.seen[i] for i in ids}

    async def close(self) -> None:
        await self.queue.delete()
        await self.queue.close()
