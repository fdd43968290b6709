"""The env worker's gateway key reaches the gateway and the agents' SDK clients (``ctx.api_key``), never the
environment of what agents start (nor does its service token, MOLT_INTERNAL_TOKEN): Molt's ``python_executor``
tool runs model-written code in a plain ``python3`` child that inherits the worker's environment, and could read
the worker's start-up environment in /proc unless the worker is not dumpable. A real worker process, the fake
gateway on loopback."""

from __future__ import annotations

import os
import sys
import textwrap

import httpx

from molt.agents.testing import FakeGateway
from molt.serve import start_service
from tests.gateway_testlib import ROOT, stop
from tests.integration.envs_testlib import Served

KEY = "sk-molt-worker-secret"
TOKEN = "molt-internal-service-token"  # MOLT_INTERNAL_TOKEN: what the trainer must send the worker
AGENT = textwrap.dedent("""
    import ctypes
    import subprocess
    import sys

    from molt.agents import Env, Result, StepEnvRunner

    SECRETS = ("MOLT_GATEWAY__API_KEY", "MOLT_INTERNAL_TOKEN")
    CHILD = f"import os; print(' '.join(os.environ.get(k, 'absent') for k in {SECRETS!r}))"

    class Probe(Env):
        async def step(self, state):
            seen = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True).stdout.strip()
            # The worker's /proc/PID/environ still holds the keys it started with: not dumpable, only root reads it.
            dumpable = ctypes.CDLL(None).prctl(3, 0, 0, 0, 0)  # PR_GET_DUMPABLE
            return Result(reward=1.0 if seen == "absent absent" and dumpable == 0 else 0.0)

    class AgentRunner(StepEnvRunner):
        def __init__(self):
            super().__init__(Probe)
""")


def test_the_gateway_key_reaches_the_gateway_but_not_the_children_agents_start(tmp_path):
    fake = FakeGateway(policy=lambda prompt, turn: "ok")
    keys: list[str | None] = []

    @fake.app.middleware("http")
    async def record(request, call_next):
        keys.append(request.headers.get("authorization"))
        return await call_next(request)

    gateway = Served(fake.app, "fake-gateway")
    (tmp_path / "probe.py").write_text(AGENT)
    cmd = [sys.executable, "-m", "services.envs", f"--agent=probe={tmp_path / 'probe.py'}"]
    cmd += ["--gateway.url", gateway.url, "--server.port", "0", "--server.log_level", "warning"]
    env = dict(os.environ, MOLT_GATEWAY__API_KEY=KEY, MOLT_INTERNAL_TOKEN=TOKEN)
    worker, url = start_service(cmd, log_path=tmp_path / "worker.log", env=env, cwd=ROOT)
    try:
        body = {"agent": "probe", "prompt": "hi", "label": "", "group_id": "g", "sample_index": 0}
        before = len(keys)  # the readiness probe's gateway calls
        bare = httpx.post(f"{url}/v1/episodes:run", json=body, timeout=60)
        assert bare.status_code == 401 and len(keys) == before  # the service token guards episodes: nothing ran
        r = httpx.post(f"{url}/v1/episodes:run", json=body, timeout=60, headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 200 and r.json()["status"] == "ok", r.text
        assert r.json()["reward"] == 1.0  # the agent's child saw neither the key nor the service token
        assert keys and set(keys) == {f"Bearer {KEY}"}  # every gateway call carried the key, never the token
    finally:
        stop(worker)
        gateway.stop()
