"""The env worker app (services.envs) against the in-memory fake gateway: admission, isolation, metrics."""

from __future__ import annotations

import asyncio
import textwrap

import httpx
import pytest

from molt.agents.testing import FakeGateway
from molt.config import parse_settings
from services.envs.app import build_app
from services.envs.config import EnvsSettings, normalize_argv

AGENTS = textwrap.dedent("""
    import asyncio
    from molt.agents import Env, Result, StepEnvRunner

    class MyEnv(Env):
        async def step(self, state):
            label = state["label"]
            if label == "raise":
                raise RuntimeError("boom")
            if label == "hang":
                await asyncio.sleep(3600)
            if label == "slow":
                await asyncio.sleep(0.3)
            if label == "no pod":
                from molt.agents.gateway import GatewayError

                raise GatewayError("POST", "/v1/sessions/x/generate", 503, "no healthy rollout pod is available")
            return Result(reward=float(label == state["action_text"]))

    class AgentRunner(StepEnvRunner):
        def __init__(self):
            super().__init__(MyEnv)
""")


@pytest.fixture
def setup(tmp_path):
    path = tmp_path / "agent.py"
    path.write_text(AGENTS)
    fake = FakeGateway(policy=lambda prompt, turn: "yes")
    settings = EnvsSettings(
        agent=[f"echo={path}"],
        gateway={"url": "http://fake"},
        envs={"max_concurrency": 2, "episode_timeout_s": 1.0, "retry_after_s": 3},
    )
    app = build_app(settings, gateway_transport=httpx.ASGITransport(app=fake.app))
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://worker")
    return fake, client


def _req(label, i=0):
    return {
        "agent": "echo",
        "prompt": "say yes",
        "label": label,
        "group_id": "g",
        "sample_index": i,
        "sampling_params": {"temperature": 1.0},
    }


async def test_episode_ok(setup):
    fake, client = setup
    r = await client.post("/v1/episodes:run", json=_req("yes"))
    body = r.json()
    assert r.status_code == 200 and body["status"] == "ok" and body["reward"] == 1.0 and body["written"]
    s = fake.sessions[body["trajectory_id"]]
    assert s.status == "finished" and s.fields["env_name"] == "echo" and len(s.fields["env_version"]) == 12
    assert body["turns"] == 1 and body["tokens"] == len("say yesyes")


async def test_failures_fail_only_their_episode(setup):
    fake, client = setup
    raised, hung = await asyncio.gather(
        client.post("/v1/episodes:run", json=_req("raise")), client.post("/v1/episodes:run", json=_req("hang"))
    )
    assert raised.json()["status"] == "failed" and "RuntimeError: boom" in raised.json()["error"]
    assert hung.json()["status"] == "timeout" and not hung.json()["written"]
    for r in (raised, hung):
        assert fake.sessions[r.json()["trajectory_id"]].status == "aborted"
    ok = await client.post("/v1/episodes:run", json=_req("yes"))
    assert ok.json()["status"] == "ok"
    metrics = (await client.get("/metrics")).text
    for status in ("ok", "failed", "timeout"):
        assert f'molt_envs_episodes_total{{agent="echo",status="{status}"}} 1.0' in metrics
    assert 'molt_envs_reward_count{agent="echo"} 1.0' in metrics and "molt_envs_inflight_episodes 0.0" in metrics


async def test_saturation_returns_429_with_retry_after(setup):
    fake, client = setup
    results = await asyncio.gather(*[client.post("/v1/episodes:run", json=_req("slow", i)) for i in range(3)])
    codes = sorted(r.status_code for r in results)
    assert codes == [200, 200, 429]
    rejected = next(r for r in results if r.status_code == 429)
    assert rejected.headers["retry-after"] == "3" and rejected.json()["error"]["type"] == "rate_limit_error"
    assert "molt_envs_rejected_total 1.0" in (await client.get("/metrics")).text


async def test_bad_requests(setup):
    _, client = setup
    r = await client.post("/v1/episodes:run", json=dict(_req("yes"), agent="nope"))
    assert r.status_code == 404 and "serves ['echo']" in r.json()["error"]["message"]
    r = await client.post("/v1/episodes:run", json={"agent": "echo"})
    assert r.status_code == 400 and "group_id" in r.json()["error"]["message"]
    r = await client.post("/v1/episodes:run", content=b"{not json")
    assert r.status_code == 400
    r = await client.post("/v1/episodes:run", json=dict(_req("yes"), sampling_params={"n": 4}))
    assert r.status_code == 400 and "own episode" in r.json()["error"]["message"]
    r = await client.post("/v1/episodes:run", json=dict(_req("yes"), prompt=""))
    assert r.status_code == 400 and "prompt is empty" in r.json()["error"]["message"]


async def test_health_and_readiness(setup):
    _, client = setup
    assert (await client.get("/healthz")).status_code == 200
    ready = await client.get("/readyz")
    assert ready.status_code == 200 and ready.json()["agents"] == ["echo"]


def test_cli_repeated_agents_and_unknown_flags(tmp_path, capsys):
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text(AGENTS)
    b.write_text(AGENTS)
    argv = normalize_argv(["--agent", f"a={a}", "--gateway.url", "http://g", f"--agent=b={b}", "--port", "7"])
    settings = parse_settings(EnvsSettings, argv, environ={})
    assert settings.agents() == {"a": str(a), "b": str(b)} and settings.server.port == 7
    with pytest.raises(SystemExit):
        parse_settings(EnvsSettings, normalize_argv(["--agent", f"a={a}", "--agnet", "x"]), environ={})
    assert "did you mean --agent" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_settings(EnvsSettings, normalize_argv(["--agent", "nopath"]), environ={})
    assert "expected NAME=PATH" in capsys.readouterr().err


class _ByHost(httpx.AsyncBaseTransport):
    """Routes each request to the in-process app named by its host."""

    def __init__(self, apps):
        self.transports = {host: httpx.ASGITransport(app=app) for host, app in apps.items()}

    async def handle_async_request(self, request):
        return await self.transports[request.url.host].handle_async_request(request)


async def test_the_dispatcher_spreads_load_over_replicas(tmp_path):
    from services.trainer.config import EnvsConfig, RolloutConfig
    from services.trainer.dispatch import EpisodeDispatcher

    path = tmp_path / "agent.py"
    path.write_text(AGENTS)
    fake = FakeGateway(policy=lambda prompt, turn: "yes")
    apps = {}
    for host in ("w1", "w2"):
        settings = EnvsSettings(
            agent=[f"echo={path}"], gateway={"url": "http://fake"}, envs={"max_concurrency": 1, "retry_after_s": 0}
        )
        apps[host] = build_app(settings, gateway_transport=httpx.ASGITransport(app=fake.app))
    dispatcher = EpisodeDispatcher(EnvsConfig(urls=["http://w1", "http://w2"]), RolloutConfig(), 256)
    dispatcher.client = httpx.AsyncClient(transport=_ByHost(apps))
    results = await asyncio.gather(*[dispatcher.run_episode(_req("slow", i)) for i in range(4)])
    assert [r["status"] for r in results] == ["ok"] * 4
    served = [
        a.state.worker.metrics["molt_envs_episodes_total"].labels("echo", "ok")._value.get() for a in apps.values()
    ]
    assert sum(served) == 4 and min(served) >= 1  # both replicas took episodes


async def test_an_episode_stopped_by_an_outage_is_a_503_to_wait_out_not_a_failure(setup):
    fake, client = setup
    r = await client.post("/v1/episodes:run", json=_req("no pod"))
    assert r.status_code == 503 and r.headers["retry-after"] == "3"
    assert "no healthy rollout pod" in r.json()["error"]["message"]
    assert all(s.status == "aborted" for s in fake.sessions.values())  # nothing written


def test_outages_are_told_from_episode_failures():
    import anthropic
    import openai

    from molt.agents.gateway import GatewayError
    from services.envs.worker import is_outage

    request = httpx.Request("POST", "http://gw/v1/chat/completions")
    answer = httpx.Response(503, request=request)
    outages = [
        GatewayError("POST", "/x", 503, "no healthy rollout pod"),
        httpx.ConnectError("refused", request=request),
        openai.InternalServerError("no pod", response=answer, body=None),  # a ChatAgent's SDK call
        openai.APIConnectionError(request=request),
        anthropic.APIConnectionError(request=request),
    ]
    for exc in outages:
        assert is_outage(exc), exc
    try:
        try:
            raise httpx.ReadError("reset", request=request)
        except httpx.ReadError as inner:
            raise RuntimeError("the agent wrapped it") from inner
    except RuntimeError as wrapped:
        assert is_outage(wrapped)
    not_outages = [
        GatewayError("POST", "/x", 400, "bad"),
        ValueError("the env's own bug"),
        openai.BadRequestError("bad", response=httpx.Response(400, request=request), body=None),
    ]
    for exc in not_outages:
        assert not is_outage(exc), exc
