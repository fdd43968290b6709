"""The service token (MOLT_INTERNAL_TOKEN, molt/auth.py): with it set, the env worker and the rollout pod answer
every route but the probes and /metrics with 401 in their own error shape unless the request carries it, and
do no work; the pod's weight reload keeps its own token. Without it, a public address is refused at start-up.
In-process apps over fakes (the real processes and clients: tests/integration/test_internal_token.py)."""

from __future__ import annotations

import textwrap

import httpx
import pytest
from fastapi.testclient import TestClient
from test_rollout_routes import FakeEngine

from molt import auth
from molt.agents.testing import FakeGateway
from molt.weightsync import auth as weights_auth
from services.envs.app import build_app as build_envs_app
from services.envs.config import EnvsSettings
from services.rollout.app import build_app as build_rollout_app
from services.rollout.config import RolloutSettings, validate_settings

TOKEN = "it-5ecret-0123456789abcdef"
WRONG_HEADERS = ({}, {"Authorization": "Bearer nope"}, {"Authorization": TOKEN}, {"Authorization": f"bearer {TOKEN}"})
GOOD = {"Authorization": f"Bearer {TOKEN}"}


def test_the_token_comes_from_the_environment_and_weightsync_keeps_its_names():
    assert (
        auth.internal_token_from_env({}) is None and auth.internal_token_from_env({"MOLT_INTERNAL_TOKEN": " "}) is None
    )
    assert auth.internal_token_from_env({"MOLT_INTERNAL_TOKEN": "abc"}) == "abc"
    assert auth.bearer_headers(None) == {} and auth.bearer_headers("abc") == {"Authorization": "Bearer abc"}
    # one implementation: weightsync's public names are the shared ones, or thin wrappers over them
    assert weights_auth.bearer_matches is auth.bearer_matches and weights_auth.is_loopback is auth.is_loopback
    assert weights_auth.token_from_env({"MOLT_WEIGHTS_TOKEN": "w", "MOLT_INTERNAL_TOKEN": "i"}) == "w"


def test_no_token_is_served_only_on_loopback_or_when_allowed():
    for ok in ((None, "127.0.0.1", False), ("t", "0.0.0.0", False), (None, "::", True), (None, "localhost", False)):
        auth.check_internal_exposure(*ok, "the pod would generate for")
    with pytest.raises(ValueError) as err:
        auth.check_internal_exposure(None, "0.0.0.0", False, "the pod would generate for")
    assert str(err.value) == (
        "the pod would generate for anyone who reaches 0.0.0.0: set MOLT_INTERNAL_TOKEN (the token its callers "
        "send), bind --server.host 127.0.0.1, or pass --server.allow_unauthenticated"
    )
    with pytest.raises(ValueError, match="set MOLT_WEIGHTS_TOKEN.*--weights.allow_unauthenticated"):
        weights_auth.check_exposure(None, "0.0.0.0", False)  # weightsync's message, as before


def test_pod_settings_refuse_a_public_address_without_the_token(monkeypatch):
    monkeypatch.setenv("MOLT_WEIGHTS_TOKEN", "w")
    monkeypatch.delenv("MOLT_INTERNAL_TOKEN", raising=False)
    public = {"model": {"path": "/fake"}, "server": {"host": "0.0.0.0"}}
    with pytest.raises(ValueError, match="set MOLT_INTERNAL_TOKEN"):
        validate_settings(RolloutSettings.model_validate(public))
    validate_settings(
        RolloutSettings.model_validate({**public, "server": {**public["server"], "allow_unauthenticated": True}})
    )
    monkeypatch.setenv("MOLT_INTERNAL_TOKEN", TOKEN)
    validate_settings(RolloutSettings.model_validate(public))


# ---------------------------------------------------------------- env worker

AGENT = textwrap.dedent("""
    from molt.agents import Env, Result, StepEnvRunner

    class MyEnv(Env):
        async def step(self, state):
            return Result(reward=1.0)

    class AgentRunner(StepEnvRunner):
        def __init__(self):
            super().__init__(MyEnv)
""")

EPISODE = {"agent": "echo", "prompt": "hi", "label": "x", "group_id": "g", "sample_index": 0, "sampling_params": {}}


def _envs(tmp_path, host: str = "127.0.0.1", **server) -> tuple[FakeGateway, httpx.AsyncClient]:
    path = tmp_path / "agent.py"
    path.write_text(AGENT)
    fake = FakeGateway(policy=lambda prompt, turn: "yes")
    settings = EnvsSettings(agent=[f"echo={path}"], gateway={"url": "http://fake"}, server={"host": host, **server})
    app = build_envs_app(settings, gateway_transport=httpx.ASGITransport(app=fake.app))
    return fake, httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://worker")


async def test_env_worker_refuses_episodes_without_the_token(tmp_path, monkeypatch):
    monkeypatch.setenv("MOLT_INTERNAL_TOKEN", TOKEN)
    fake, client = _envs(tmp_path, "0.0.0.0")
    for headers in WRONG_HEADERS:
        r = await client.post("/v1/episodes:run", json=EPISODE, headers=headers)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        error = r.json()["error"]
        assert error["type"] == "authentication_error" and error["code"] == 401  # the worker's own shape
        assert "Authorization: Bearer <MOLT_INTERNAL_TOKEN>" in error["message"] and TOKEN not in r.text
    assert (await client.post("/v1/nope", headers={})).status_code == 401  # not even routing answers
    assert fake.sessions == {}  # no episode ran
    for probe in auth.OPEN_PATHS:
        assert (await client.get(probe)).status_code == 200, probe
    r = await client.post("/v1/episodes:run", json=EPISODE, headers=GOOD)
    assert r.status_code == 200 and r.json()["status"] == "ok" and len(fake.sessions) == 1


async def test_env_worker_without_a_token_is_open_and_refused_on_a_public_address(tmp_path, monkeypatch):
    monkeypatch.delenv("MOLT_INTERNAL_TOKEN", raising=False)
    _, client = _envs(tmp_path)
    assert (await client.post("/v1/episodes:run", json=EPISODE)).status_code == 200
    with pytest.raises(ValueError, match="env worker would run episodes for anyone who reaches 0.0.0.0: set MOLT_"):
        _envs(tmp_path, "0.0.0.0")
    _envs(tmp_path, "0.0.0.0", allow_unauthenticated=True)


# ---------------------------------------------------------------- rollout pod


class _CountingEngine(FakeEngine):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    async def generate(self, prompt, params):
        self.calls.append("generate")
        return await super().generate(prompt, params)

    async def reload_from_path(self, path, version):
        self.calls.append("reload")
        return {"policy_version": version}


def _pod(monkeypatch, engine: FakeEngine) -> TestClient:
    monkeypatch.setenv("MOLT_INTERNAL_TOKEN", TOKEN)
    monkeypatch.setenv("MOLT_WEIGHTS_TOKEN", "weights-t0k")
    settings = RolloutSettings.model_validate({"model": {"path": "/fake"}, "server": {"host": "0.0.0.0"}})
    return TestClient(build_rollout_app(settings, engine=engine))


def test_pod_refuses_every_guarded_route_without_the_token(monkeypatch):
    engine = _CountingEngine()
    body = {"prompt_token_ids": [1, 2], "sampling_params": {"max_tokens": 2}}
    with _pod(monkeypatch, engine) as client:
        guarded = [
            ("POST", "/v1/generate", body),
            ("POST", "/v1/generate_stream", None),
            ("POST", "/v1/prompt_logprobs", {"token_ids": [1, 2]}),
            ("GET", "/v1/version", None),
            ("GET", "/v1/stats", None),
            ("GET", "/v1/weights/expected", None),
            ("GET", "/nope", None),
        ]
        for method, path, payload in guarded:
            for headers in WRONG_HEADERS:
                r = client.request(method, path, json=payload, headers=headers)
                assert r.status_code == 401, (path, headers, r.text)
                assert r.json()["error"] == {  # the pod's OpenAI error shape
                    "message": r.json()["error"]["message"],
                    "type": "authentication_error",
                    "param": None,
                    "code": "invalid_internal_token",
                }
                assert "MOLT_INTERNAL_TOKEN" in r.text and TOKEN not in r.text
                assert r.headers["www-authenticate"] == "Bearer"
        assert engine.calls == []
        for probe in auth.OPEN_PATHS:
            assert client.get(probe).status_code == 200, probe
        r = client.post("/v1/generate", json=body, headers=GOOD)
        assert r.status_code == 200 and r.json()["outputs"][0]["token_ids"] == [7, 7]
        assert client.get("/v1/version", headers=GOOD).status_code == 200
        assert engine.calls == ["generate"]


def test_pod_weight_reload_keeps_its_own_token(monkeypatch):
    engine = _CountingEngine()
    reload = {"path": "/m", "version": 4}
    with _pod(monkeypatch, engine) as client:
        r = client.post("/v1/weights/reload", json=reload, headers=GOOD)  # the service token is not the weights'
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_weights_token"
        r = client.post("/v1/weights/reload", json=reload, headers={"Authorization": "Bearer weights-t0k"})
        assert r.status_code == 200 and engine.calls == ["reload"]


def test_pod_without_a_token_is_open(monkeypatch):
    monkeypatch.delenv("MOLT_INTERNAL_TOKEN", raising=False)
    settings = RolloutSettings.model_validate({"model": {"path": "/fake"}})
    with TestClient(build_rollout_app(settings, engine=FakeEngine())) as client:
        assert client.get("/v1/version").status_code == 200
