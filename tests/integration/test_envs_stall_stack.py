"""A real worker process whose agent blocks its event loop in a socket read without a timeout: the log names the
agent and the line while it is stuck, the probes do not answer meanwhile (on purpose: the chart's readiness and
liveness probes take a stuck worker out and restart it), and the worker serves again once the read returns."""

from __future__ import annotations

import os
import socket
import sys
import textwrap
import threading
import time

import httpx
import pytest

from molt.agents.testing import FakeGateway
from molt.serve import start_service
from tests.gateway_testlib import ROOT, stop
from tests.integration.envs_testlib import Served

AGENT = textwrap.dedent("""
    import socket

    from molt.agents import Env, Result, StepEnvRunner

    class Reader(Env):
        async def step(self, state):
            with socket.create_connection(("127.0.0.1", int(state["label"]))) as sock:
                sock.recv(1)  # no timeout: blocks the event loop until the test sends a byte
            return Result(reward=1.0)

    class AgentRunner(StepEnvRunner):
        def __init__(self):
            super().__init__(Reader)
""")
LINE = (
    AGENT.splitlines().index(
        "            sock.recv(1)  # no timeout: blocks the event loop until the test sends a byte"
    )
    + 1
)


def _wait_for(log_path, text: str, timeout_s: float = 60.0) -> str:
    deadline = time.monotonic() + timeout_s
    while text not in (log := log_path.read_text()):
        if time.monotonic() > deadline:
            pytest.fail(f"{text!r} never reached the worker's log:\n{log}")
        time.sleep(0.1)
    return log


def test_a_blocked_loop_is_named_in_the_log_and_fails_the_probes_until_it_runs_again(tmp_path):
    gateway = Served(FakeGateway(policy=lambda prompt, turn: "ok").app, "fake-gateway")
    (tmp_path / "reader.py").write_text(AGENT)
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(60)
    cmd = [sys.executable, "-m", "services.envs", f"--agent=reader={tmp_path / 'reader.py'}"]
    cmd += ["--gateway.url", gateway.url, "--server.port", "0", "--server.log_level", "warning"]
    cmd += ["--envs.stall_warn_s", "1"]
    log_path = tmp_path / "worker.log"
    env = {k: v for k, v in os.environ.items() if k != "MOLT_INTERNAL_TOKEN"}  # a loopback worker without a token
    worker, url = start_service(cmd, log_path=log_path, env=env, cwd=ROOT)
    answers: list[httpx.Response] = []
    body = {"agent": "reader", "prompt": "hi", "label": listener.getsockname()[1], "group_id": "g"}
    episode = threading.Thread(
        target=lambda: answers.append(httpx.post(f"{url}/v1/episodes:run", json=body, timeout=120))
    )
    try:
        episode.start()
        conn, _ = listener.accept()  # the agent's read has begun
        log = _wait_for(log_path, "event loop blocked for ")
        assert "of agent 'reader'" in log and "asyncio.to_thread" in log
        assert f'File "{tmp_path / "reader.py"}", line {LINE}, in step\n    sock.recv(1)' in log
        with pytest.raises(httpx.TimeoutException):  # the probes wait on the loop too
            httpx.get(f"{url}/healthz", timeout=2)
        conn.sendall(b"x")
        episode.join(60)
        assert answers and answers[0].json()["status"] == "ok", answers
        _wait_for(log_path, "event loop ran again after about ")
        assert httpx.get(f"{url}/healthz", timeout=10).status_code == 200
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        assert 'molt_envs_event_loop_stalls_total{agent="reader"} 1.0' in metrics
        conn.close()
    finally:
        stop(worker)
        listener.close()
        gateway.stop()
