"""Route adapters and error mapping of the rollout app, over a fake engine (no vLLM)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from services.rollout.app import build_app
from services.rollout.config import RolloutSettings
from services.rollout.engine import GenerateResult, Sample
from services.rollout.params import Limits, RolloutInputError, check_prompt, check_sampling
from services.rollout.stats import EngineStats


class FakeEngine:
    """Just the members the routes and metrics read; validates like the real engine."""

    def __init__(self) -> None:
        self.policy_version, self.dead, self.stats = 3, None, EngineStats(running=2, max_running=5)
        self.weight_apply_s, self.aborts = [0.02], {"client_disconnect": 1}
        self.limits = Limits(vocab_size=100, max_model_len=32, max_n=4)
        self.ready = False

    async def start(self) -> None:
        self.ready = True

    async def close(self) -> None:
        self.ready = False

    async def generate(self, prompt, params):
        if prompt == [99]:
            raise RuntimeError("engine fell over")
        p = check_sampling(params, len(check_prompt(prompt, self.limits)), self.limits)
        samples = [Sample([7] * p["max_tokens"], [-0.5] * p["max_tokens"], "length", None, 3) for _ in range(p["n"])]
        return GenerateResult("rid", 3, len(prompt), samples)

    serving_dtype = ""
    vocab = "0123456789abcdef"

    def expected_parameters(self):
        return {"w": ((2, 3), "float32")}


@pytest.fixture()
def client():
    settings = RolloutSettings.model_validate({"model": {"path": "/fake"}})
    with TestClient(build_app(settings, engine=FakeEngine())) as c:
        yield c


def test_generate_shape(client):
    r = client.post("/v1/generate", json={"prompt_token_ids": [1, 2], "sampling_params": {"n": 2, "max_tokens": 3}})
    assert r.status_code == 200
    body = r.json()
    assert body["policy_version"] == 3 and body["prompt_token_count"] == 2
    assert body["outputs"][1] == {
        "index": 1,
        "token_ids": [7, 7, 7],
        "logprobs": [-0.5] * 3,
        "finish_reason": "length",
        "stop_reason": None,
        "policy_version": 3,
    }


def test_errors_use_the_openai_body(client):
    r = client.post("/v1/generate", json={"prompt_token_ids": [1], "sampling_params": {"max_tokens": 40}})
    assert r.status_code == 400
    assert r.json()["error"] == {
        "message": r.json()["error"]["message"],
        "type": "invalid_request_error",
        "param": "sampling_params.max_tokens",
        "code": "context_length_exceeded",
    }
    assert client.post("/v1/generate", content=b"[1,").status_code == 400
    assert client.post("/v1/generate", json=[1, 2]).status_code == 400
    r = client.post("/v1/generate", json={"prompt_token_ids": [99]})
    assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"
    r = client.post("/v1/weights/reload", json={"path": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "path"


def test_probes_and_metrics(client):
    ready = {"ready": True, "policy_version": 3, "grpc_port": None, "vocab": "0123456789abcdef", "max_logprobs": 20}
    assert client.get("/readyz").json() == ready
    assert client.get("/v1/version").json()["policy_version"] == 3
    assert client.get("/v1/weights/expected").json() == {"parameters": {"w": {"shape": [2, 3], "dtype": "float32"}}}
    assert client.get("/v1/stats").json()["max_running"] == 5
    client.post("/v1/generate", json={"prompt_token_ids": [1], "sampling_params": {"max_tokens": 4}})
    text = client.get("/metrics").text
    for line in [
        "molt_rollout_policy_version 3.0",
        "molt_rollout_running_requests 2.0",
        'molt_rollout_requests_total{status="ok"} 1.0',
        "molt_rollout_generated_tokens_total 4.0",
        'molt_rollout_request_aborts_total{reason="client_disconnect"} 1.0',
        "molt_rollout_weight_apply_seconds_count 1.0",
    ]:
        assert line in text, line


def test_input_error_is_a_value_error():
    assert issubclass(RolloutInputError, ValueError)


def test_return_routed_experts_is_a_boolean(client):
    body = {"prompt_token_ids": [1, 2], "return_routed_experts": "yes"}
    r = client.post("/v1/generate", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "return_routed_experts"
