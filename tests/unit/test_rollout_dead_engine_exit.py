"""A pod whose engine dies stops serving and exits 1, the way SIGTERM stops it (fake engine, real server)."""

from __future__ import annotations

import asyncio
import time

import httpx

from services.rollout.__main__ import serve_pod
from services.rollout.app import build_app
from services.rollout.config import RolloutSettings


class DyingEngine:
    """Starts at once; ``die()`` does what the engine thread does when it fails."""

    policy_version = 0
    vocab = ""

    def __init__(self) -> None:
        self.dead: BaseException | None = None
        self._failed = asyncio.Event()
        self.started = False

    @property
    def ready(self) -> bool:
        return self.started and self.dead is None

    @property
    def failed(self) -> bool:
        return self._failed.is_set()

    async def start(self) -> None:
        self.started = True

    async def close(self) -> None:
        pass

    async def stop_watching(self) -> None:
        pass

    async def wait_failed(self) -> BaseException:
        await self._failed.wait()
        return self.dead

    def die(self) -> None:
        self.dead = RuntimeError("injected engine failure")
        self._failed.set()


def test_an_engine_failure_turns_readyz_503_and_serve_pod_returns_1(capsys):
    settings = RolloutSettings.model_validate(
        {"model": {"path": "unused"}, "server": {"host": "127.0.0.1", "port": 0}}
    )
    engine = DyingEngine()
    app = build_app(settings, engine=engine)

    async def scenario() -> tuple[int, int, int]:
        served = asyncio.ensure_future(serve_pod(app, settings.server, graceful_s=2))
        deadline = time.monotonic() + 30
        while "molt-rollout ready" not in (out := capsys.readouterr().out):
            assert time.monotonic() < deadline and not served.done()
            await asyncio.sleep(0.02)
        url = out.split("molt-rollout ready ")[1].split()[0]
        async with httpx.AsyncClient(base_url=url) as client:
            before = (await client.get("/readyz")).status_code
            engine.dead = RuntimeError("dying")  # what the engine thread sets first
            after = (await client.get("/readyz")).status_code
        engine.die()
        return before, after, await asyncio.wait_for(served, 30)

    assert asyncio.run(scenario()) == (200, 503, 1)


def test_a_sigterm_is_still_exit_code_0(capsys):
    import os
    import signal

    settings = RolloutSettings.model_validate(
        {"model": {"path": "unused"}, "server": {"host": "127.0.0.1", "port": 0}}
    )
    app = build_app(settings, engine=DyingEngine())

    async def scenario() -> int:
        served = asyncio.ensure_future(serve_pod(app, settings.server, graceful_s=2))
        deadline = time.monotonic() + 30
        while "molt-rollout ready" not in capsys.readouterr().out:
            assert time.monotonic() < deadline and not served.done(), "pod did not start"
            await asyncio.sleep(0.02)
        os.kill(os.getpid(), signal.SIGTERM)
        return await asyncio.wait_for(served, 30)

    assert asyncio.run(scenario()) == 0
