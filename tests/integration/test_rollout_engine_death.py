"""A rollout pod whose engine dies anyway (no input can kill it any more: a command that raises on the engine
thread stands in) answers 503, turns /readyz and /healthz 503, and ``serve_pod`` returns exit code 1 so
that Kubernetes restarts it. Its own module: one in-process vLLM engine per process, and these start theirs."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from http_fuzz import assert_openai_error
from rollout_testlib import PROMPT, ServerThread, tiny_settings

from services.rollout.__main__ import serve_pod
from services.rollout.app import build_app
from services.rollout.engine import _NO_RESULT

pytestmark = [pytest.mark.timeout(300), pytest.mark.vllm]


def _kill_engine_thread(engine) -> None:
    """An engine failure no input can cause any more: a command that raises on the engine thread."""

    def boom(llm, jobs):
        raise RuntimeError("injected engine failure")

    engine._cmds.put((boom, _NO_RESULT))


def test_a_pod_whose_engine_dies_stops_serving_and_returns_exit_code_1(tiny_qwen3, capsys):
    """``python -m services.rollout`` runs ``serve_pod`` and exits with what it returns."""
    app = build_app(tiny_settings(tiny_qwen3))
    server = app.state.settings.server
    server.host, server.port = "127.0.0.1", 0

    async def scenario() -> int:
        served = asyncio.ensure_future(serve_pod(app, server, graceful_s=5))
        deadline = time.monotonic() + 120
        while "molt-rollout ready" not in capsys.readouterr().out:  # printed once SIGTERM is the pod's to handle
            assert time.monotonic() < deadline and not served.done(), "pod did not start"
            await asyncio.sleep(0.05)
        _kill_engine_thread(app.state.engine)
        return await asyncio.wait_for(served, 60)

    assert asyncio.run(scenario()) == 1  # main() turns it into the exit code that makes Kubernetes restart the pod
    assert app.state.engine.failed and not app.state.engine.ready


def test_after_an_engine_failure_readyz_and_healthz_are_503_and_requests_503(tiny_qwen3):
    app = build_app(tiny_settings(tiny_qwen3))
    with ServerThread(app) as url, httpx.Client(base_url=url, timeout=60) as client:
        ok = client.post("/v1/generate", json={"prompt_token_ids": PROMPT, "sampling_params": {"max_tokens": 2}})
        assert ok.status_code == 200 and client.get("/readyz").status_code == 200
        _kill_engine_thread(app.state.engine)
        deadline = time.monotonic() + 30
        while app.state.engine.dead is None:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert client.get("/readyz").status_code == 503 and client.get("/healthz").status_code == 503
        missing = client.get("/nope")
        assert_openai_error(missing.status_code, missing.content, {404})
        r = client.post("/v1/generate", json={"prompt_token_ids": PROMPT, "sampling_params": {"max_tokens": 2}})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_error"
