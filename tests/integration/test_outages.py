"""Outages are waited out, not turned into data loss: a real redis-server (append-only file on) killed and
restarted by pid under a real gateway process and a real env worker process, with real episodes.

The outage lasts ``MOLT_TEST_OUTAGE_S`` seconds (3 in CI; the soak, bench/soak.py, runs 30 s ones). While
Redis is down: both services report not-ready, callers get 503 + Retry-After (never 500) on session open,
finish and /v1/episodes, and turns go on. Once it is back: every finish retried (by a client, or by the env
worker on its own) is written, each trajectory exactly once, and those written before the outage survived.
A Redis that holds a finish's write a while: an abort of the session arriving meanwhile waits for the finish and
answers that the session is finished.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from molt.bus.embedded import EmbeddedRedis
from molt.serve import start_service
from tests.gateway_testlib import (
    ROOT,
    _env,
    read_trajectories,
    start_gateway,
    start_instant_pod,
    stop,
)

pytestmark = [pytest.mark.redis, pytest.mark.timeout(240)]

OUTAGE_S = float(os.environ.get("MOLT_TEST_OUTAGE_S", "3"))
KEY = {"authorization": "Bearer k1"}
STREAM = "molt:outage"

# One turn; the step waits label["sleep_s"] first, so the finish can be timed to land in the outage.
AGENT = textwrap.dedent("""
    import asyncio

    from molt.agents import Env, Result, StepEnvRunner


    class WaitEnv(Env):
        async def step(self, state):
            await asyncio.sleep(float(state["label"]["sleep_s"]))
            return Result(reward=1.0)


    class AgentRunner(StepEnvRunner):
        def __init__(self):
            super().__init__(WaitEnv)
""")


def start_worker(gateway: str, agent: Path, log: Path, lease_s: float = 60.0) -> tuple[subprocess.Popen, str]:
    cmd = [
        sys.executable,
        "-m",
        "services.envs",
        "--agent",
        f"wait={agent}",
        "--gateway.url",
        gateway,
        "--gateway.api_key",
        "k1",
        "--envs.session_lease_s",
        str(lease_s),
        "--envs.finish_retry_s",
        "120",
        "--server.port",
        "0",
        "--server.log_level",
        "warning",
    ]
    return start_service(cmd, log_path=log, env=_env(), cwd=ROOT, timeout_s=60)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_qwen3):
    tmp = tmp_path_factory.mktemp("outage")
    redis = EmbeddedRedis(data_dir=tmp / "redis", log_dir=tmp).start()
    procs: list[subprocess.Popen] = []
    try:
        pod, pod_url = start_instant_pod(tmp / "pod.log")
        procs.append(pod)
        gw, gw_url = start_gateway(
            [
                "--model.path",
                str(tiny_qwen3),
                "--rollout.urls",
                pod_url,
                "--redis.url",
                redis.url,
                "--redis.stream",
                STREAM,
                "--auth.api_keys",
                "k1",
                "--auth.max_open_sessions_per_key",
                "2000",
                "--session.finish_wait_s",
                "0.5",
                "--rollout.health_interval_s",
                "0.5",
            ],
            tmp / "gateway.log",
        )
        procs.append(gw)
        agent = tmp / "wait_agent.py"
        agent.write_text(AGENT)
        worker, worker_url = start_worker(gw_url, agent, tmp / "worker.log")
        procs.append(worker)
        yield {"redis": redis, "gateway": gw_url, "worker": worker_url, "agent": agent, "tmp": tmp}
    finally:
        for p in reversed(procs):
            stop(p)
        redis.stop()


async def _until(check, timeout_s: float = 30.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        await asyncio.sleep(0.1)


async def _status(http: httpx.AsyncClient, url: str) -> int:
    try:
        return (await http.get(url, timeout=5)).status_code
    except httpx.HTTPError:
        return 0


async def _turn(http: httpx.AsyncClient, sid: str) -> None:
    r = await http.post(
        f"/s/{sid}/v1/chat/completions", headers=KEY, json={"messages": [{"role": "user", "content": "hi"}]}
    )
    assert r.status_code == 200, r.text


async def test_500_concurrent_session_opens_with_keys_all_open(stack):
    async with httpx.AsyncClient(
        base_url=stack["gateway"], timeout=60, limits=httpx.Limits(max_connections=500)
    ) as http:
        rs = await asyncio.gather(*(http.post("/v1/sessions", json={}, headers=KEY) for _ in range(500)))
        assert Counter(r.status_code for r in rs) == {201: 500}
        gone = await asyncio.gather(*(http.delete(f"/v1/sessions/{r.json()['session_id']}", headers=KEY) for r in rs))
        assert {r.status_code for r in gone} == {200}


async def test_a_redis_outage_is_waited_out_and_nothing_finished_is_lost(stack):
    redis, statuses = stack["redis"], Counter()
    async with (
        httpx.AsyncClient(base_url=stack["gateway"], timeout=60) as http,
        httpx.AsyncClient(base_url=stack["worker"], timeout=120) as worker,
    ):

        async def post(path: str, body: dict) -> httpx.Response:
            r = await http.post(path, json=body, headers=KEY)
            statuses[r.status_code] += 1
            return r

        sids = [(await post("/v1/sessions", {})).json()["session_id"] for _ in range(6)]
        for sid in sids:
            await _turn(http, sid)
        before = [(await post(f"/v1/sessions/{sid}/finish", {"reward": 1.0})).json() for sid in sids[:2]]
        assert all(b["written"] for b in before)
        # Episodes whose finish falls inside the outage: the worker holds them until Redis is back.
        episodes = [
            asyncio.create_task(
                worker.post(
                    "/v1/episodes:run",
                    json={
                        "agent": "wait",
                        "prompt": "hi",
                        "group_id": f"g{i}",
                        "label": {"sleep_s": 1.0},
                        "sampling_params": {"max_tokens": 4},
                    },
                )
            )
            for i in range(4)
        ]
        await asyncio.sleep(0.3)  # the episodes' sessions are open and in their step
        redis.kill()
        down_at = time.monotonic()

        await _until(lambda: _not_ready(http, "/readyz"), what="gateway 503")
        await _until(lambda: _not_ready(worker, "/readyz"), what="env worker 503")
        r = await post("/v1/sessions", {})
        assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1, r.text
        for sid in sids[2:4]:
            r = await post(f"/v1/sessions/{sid}/finish", {"reward": 0.5})
            assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
            assert r.json()["error"]["code"] == "queue_unavailable"
        r = await post("/v1/episodes", {"episodes": [{"session_id": sid, "reward": 0.25} for sid in sids[4:]]})
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        await _turn(http, sids[2])  # the rollout side does not need Redis: the session goes on

        await asyncio.sleep(max(0.0, OUTAGE_S - (time.monotonic() - down_at)))
        redis.start()
        await _until(lambda: _ready(http, "/readyz"), what="gateway ready again")
        # The pooled connections recovered: the first finish after the restart is written.
        after = [(await post(f"/v1/sessions/{sid}/finish", {"reward": 0.5})).json() for sid in sids[2:4]]
        r = await post("/v1/episodes", {"episodes": [{"session_id": sid, "reward": 0.25} for sid in sids[4:]]})
        assert r.status_code == 200 and r.json()["written"] == 2, r.text
        assert all(a["written"] for a in after)
        again = await post(f"/v1/sessions/{sids[0]}/finish", {"reward": 1.0})
        assert again.json()["entry_id"] == before[0]["entry_id"]  # a repeated finish writes nothing new
        done = [(await t).json() for t in episodes]
        assert [d["status"] for d in done] == ["ok"] * 4 and all(d["written"] for d in done), done
        await _until(lambda: _ready(worker, "/readyz"), what="env worker ready again")

    assert 500 not in statuses and statuses[503] >= 4, statuses
    written = Counter(t.trajectory_id for t in await asyncio.to_thread(read_trajectories, redis.url, STREAM))
    expected = set(sids) | {d["trajectory_id"] for d in done}
    assert set(written) == expected and set(written.values()) == {1}, written


async def test_an_abort_while_the_finish_writes_waits_for_it_and_says_finished(stack):
    """A caller's abort (its own timeout) that reaches the gateway while the finish is being written (Redis holds
    writes: CLIENT PAUSE WRITE) is answered once the write is done: 409, the trajectory landed once."""
    import redis.asyncio as aioredis

    r = aioredis.from_url(stack["redis"].url)
    try:
        async with httpx.AsyncClient(base_url=stack["gateway"], timeout=30) as http:
            sid = (await http.post("/v1/sessions", json={}, headers=KEY)).json()["session_id"]
            await _turn(http, sid)
            await r.execute_command("CLIENT", "PAUSE", 2000, "WRITE")
            finish = asyncio.create_task(http.post(f"/v1/sessions/{sid}/finish", json={"reward": 1.0}, headers=KEY))
            await asyncio.sleep(0.5)  # the finish is in its write, held by the pause
            abort = await http.delete(f"/v1/sessions/{sid}", headers=KEY)
            done = await finish
    finally:
        await r.execute_command("CLIENT", "UNPAUSE")
        await r.aclose()
    assert done.status_code == 200 and done.json()["written"], done.text
    assert abort.status_code == 409 and abort.json()["error"]["code"] == "session_closed", abort.text
    written = Counter(t.trajectory_id for t in await asyncio.to_thread(read_trajectories, stack["redis"].url, STREAM))
    assert written[sid] == 1


async def _ready(http: httpx.AsyncClient, path: str) -> bool:
    return await _status(http, path) == 200


async def _not_ready(http: httpx.AsyncClient, path: str) -> bool:
    return await _status(http, path) == 503


async def test_a_dead_workers_sessions_close_within_its_lease(stack):
    tmp = stack["tmp"]
    proc, url = start_worker(stack["gateway"], stack["agent"], tmp / "worker2.log", lease_s=1.5)
    try:
        async with (
            httpx.AsyncClient(base_url=stack["gateway"], timeout=30) as http,
            httpx.AsyncClient(base_url=url, timeout=60) as worker,
        ):
            base = await _open_sessions(http)
            run = asyncio.create_task(
                worker.post(
                    "/v1/episodes:run",
                    json={
                        "agent": "wait",
                        "prompt": "hi",
                        "group_id": "long",
                        "label": {"sleep_s": 600},
                        "sampling_params": {"max_tokens": 4},
                    },
                )
            )
            await _until(lambda: _open_count_is(http, base + 1), what="the episode's session open")
            await asyncio.sleep(4.0)  # well past its lease: renewed by the live worker, still open
            assert await _open_sessions(http) == base + 1
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            run.cancel()
            # Closed by its lapsed lease (the gateway reaps every few seconds), not by --session.idle_ttl_s.
            await _until(lambda: _open_count_is(http, base), timeout_s=20, what="the dead worker's session closed")
    finally:
        stop(proc)


async def _open_sessions(http: httpx.AsyncClient) -> int:
    text = (await http.get("/metrics")).text
    return int(
        float(next(line.split()[-1] for line in text.splitlines() if line.startswith("molt_gateway_open_sessions ")))
    )


async def _open_count_is(http: httpx.AsyncClient, n: int) -> bool:
    return await _open_sessions(http) == n


async def test_a_write_retried_after_its_answer_was_lost_lands_once(stack):
    from molt.bus.redis_stream import RedisTrajectoryQueue

    q = RedisTrajectoryQueue(stack["redis"].url, "molt:outage:once")
    try:
        first = await q.put_once([b"a", b"b"], ["t1", "t2"], keep_s=60)
        # The same call again (its first answer never arrived) writes only what is new.
        again = await q.put_once([b"a", b"b", b"c"], ["t1", "t2", "t3"], keep_s=60)
        assert all(first) and again[:2] == ["", ""] and again[2]
        assert await q.redis.xlen(q.stream) == 3
    finally:
        await q.redis.delete(q.stream, *(q.written_key(t) for t in ("t1", "t2", "t3")))
        await q.close()
