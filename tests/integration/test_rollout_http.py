"""A rollout pod over real HTTP on loopback: parity, batching, bad input, weights, disconnects, CLI."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
import torch
from rollout_testlib import PROMPT, ServerThread, hf_token_logprobs, max_abs_diff, tiny_settings
from transformers import AutoTokenizer

from molt.serve import cpu_env
from services.gateway.chat import ChatModel
from services.rollout.app import build_app

pytestmark = pytest.mark.timeout(300)
TOL = 1e-4


@pytest.fixture(scope="module")
def pod(tiny_qwen3):
    app = build_app(tiny_settings(tiny_qwen3))
    with ServerThread(app) as url:
        yield url, app


def test_generate_answer_shape_and_parity(pod, tiny_qwen3):
    url, _ = pod
    body = {
        "prompt_token_ids": PROMPT,
        "sampling_params": {"n": 2, "max_tokens": 8, "temperature": 1.0, "seed": 5, "ignore_eos": True},
    }
    r = httpx.post(f"{url}/v1/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["policy_version"] == 0 and len(answer["outputs"]) == 2
    for out in answer["outputs"]:
        assert set(out) >= {"token_ids", "logprobs", "finish_reason", "policy_version"}
        assert out["finish_reason"] == "length" and len(out["token_ids"]) == 8
        assert max_abs_diff(out["logprobs"], hf_token_logprobs(tiny_qwen3, PROMPT, out["token_ids"])) < TOL


def test_top_logprobs_are_the_models_k_best_and_a_choice_constrains_the_tokens(pod, tiny_qwen3):
    url, _ = pod
    params = {"max_tokens": 4, "seed": 3, "ignore_eos": True, "top_logprobs": 3, "logit_bias": {"7": -100}}
    r = httpx.post(f"{url}/v1/generate", json={"prompt_token_ids": PROMPT, "sampling_params": params}, timeout=60)
    assert r.status_code == 200, r.text
    [out] = r.json()["outputs"]
    ids = out["token_ids"]
    assert 7 not in ids and len(out["top_logprobs"]) == len(ids)
    logits = _hf_logits(tiny_qwen3, PROMPT + ids)
    logits[:, 7] -= 100  # vLLM adds the bias before it computes logprobs: they are the biased distribution's
    for i, best in enumerate(out["top_logprobs"]):
        ref = torch.log_softmax(logits[len(PROMPT) - 1 + i], dim=-1).topk(3)
        assert [t for t, _ in best] == ref.indices.tolist()
        assert max_abs_diff([lp for _, lp in best], ref.values.tolist()) < TOL
    choice = {"max_tokens": 8, "seed": 4, "structured_outputs": {"choice": ["yes", "no way"]}}
    r = httpx.post(f"{url}/v1/generate", json={"prompt_token_ids": PROMPT, "sampling_params": choice}, timeout=120)
    assert r.status_code == 200, r.text
    [out] = r.json()["outputs"]
    text = AutoTokenizer.from_pretrained(str(tiny_qwen3)).decode(out["token_ids"], skip_special_tokens=True)
    assert text in ("yes", "no way") and out["finish_reason"] == "stop"


def _hf_logits(model, ids: list[int]):
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        net = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
        return net(torch.tensor([ids])).logits[0].float()


async def test_32_concurrent_requests_complete_and_are_batched(pod):
    url, app = pod
    engine = app.state.engine
    engine.stats.max_running = 0
    steps_before = engine.stats.steps
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=httpx.Limits(max_connections=64)) as client:
        bodies = [
            {
                "prompt_token_ids": PROMPT[: 3 + i % 7],
                "sampling_params": {"max_tokens": 16, "ignore_eos": True, "seed": i},
            }
            for i in range(32)
        ]
        answers = await asyncio.gather(*(client.post("/v1/generate", json=b) for b in bodies))
        metrics = (await client.get("/metrics")).text
    assert [a.status_code for a in answers] == [200] * 32
    assert all(len(a.json()["outputs"][0]["token_ids"]) == 16 for a in answers)
    # vLLM's own scheduler stats: more than one request ran in the same step, and far fewer
    # steps were taken than 32 sequential requests would need (32 x 16 decode steps).
    assert engine.stats.max_running > 1
    assert engine.stats.steps - steps_before < 32 * 16 / 2
    assert "molt_rollout_generated_tokens_total" in metrics and "molt_rollout_kv_cache_usage_ratio" in metrics


@pytest.mark.parametrize(
    "body,status,needle",
    [
        ({"prompt_token_ids": [5, 1024], "sampling_params": {}}, 400, "[0, 1024)"),
        ({"prompt_token_ids": PROMPT, "sampling_params": {"max_tokens": 300}}, 400, "context length 256"),
        ({"prompt_token_ids": PROMPT, "sampling_params": {"n": 100000}}, 400, "[1, 64]"),
        ({"prompt_token_ids": PROMPT, "sampling_params": {"temprature": 1.0}}, 400, "temprature"),
        ({"prompt_token_ids": "hello", "sampling_params": {}}, 400, "list of token ids"),
        ({"prompt_token_ids": PROMPT, "sampling_params": {"top_p": 0}}, 400, "top_p"),
        ({"prompt": "hi"}, 400, "unknown field"),
        (b"{not json", 400, "not valid JSON"),
    ],
)
def test_bad_input_is_a_400_that_names_the_limit(pod, body, status, needle):
    url, _ = pod
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(f"{url}/v1/generate", timeout=30, **kwargs)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and needle in err["message"]
    ok = httpx.post(
        f"{url}/v1/generate", json={"prompt_token_ids": PROMPT, "sampling_params": {"max_tokens": 2}}, timeout=30
    )
    assert ok.status_code == 200


def test_client_disconnect_aborts_the_request(pod):
    url, app = pod
    engine = app.state.engine
    before = engine.aborts.get("client_disconnect", 0)
    body = {"prompt_token_ids": PROMPT, "sampling_params": {"max_tokens": 240, "ignore_eos": True, "n": 2}}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/generate", json=body, timeout=httpx.Timeout(30, read=0.15))
    deadline = time.monotonic() + 10
    while engine.aborts.get("client_disconnect", 0) < before + 1 or engine._inflight:
        assert time.monotonic() < deadline, "request was not aborted"
        time.sleep(0.02)


def test_probes_health_and_weight_reload(pod, tiny_qwen3, tiny_qwen3_b):
    url, app = pod
    ready = httpx.get(f"{url}/readyz").json()
    # The fingerprint of vLLM's tokenizer is the gateway's (an HF tokenizer) for the same model: it is what the
    # gateway compares before routing to the pod.
    vocab = ChatModel(tiny_qwen3).vocab
    assert ready == {
        "ready": True,
        "policy_version": app.state.engine.policy_version,
        "grpc_port": None,
        "vocab": vocab,
        "max_logprobs": 20,
    }
    assert httpx.get(f"{url}/healthz").status_code == 200
    expected = httpx.get(f"{url}/v1/weights/expected").json()["parameters"]
    assert expected["model.norm.weight"] == {"shape": [128], "dtype": "float32"}
    v = httpx.get(f"{url}/v1/version").json()["policy_version"]
    r = httpx.post(f"{url}/v1/weights/reload", json={"path": str(tiny_qwen3_b), "version": v + 1}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["version"] == v + 1 and r.json()["untouched"] == []
    assert httpx.get(f"{url}/v1/version").json()["policy_version"] == v + 1
    probe = httpx.post(f"{url}/v1/prompt_logprobs", json={"token_ids": PROMPT}, timeout=30).json()
    assert probe["policy_version"] == v + 1
    assert max_abs_diff(probe["logprobs"], hf_token_logprobs(tiny_qwen3_b, PROMPT[:1], PROMPT[1:])) < TOL
    stale = httpx.post(f"{url}/v1/weights/reload", json={"path": str(tiny_qwen3_b), "version": v + 1}, timeout=30)
    assert stale.status_code == 400 and "already serves" in stale.json()["error"]["message"]
    metrics = httpx.get(f"{url}/metrics").text
    assert f"molt_rollout_policy_version {float(v + 1)}" in metrics
    assert "molt_rollout_weight_apply_seconds_count 1.0" in metrics


def test_pod_process_serves_and_stops_on_sigterm(tiny_qwen3):
    """`python -m services.rollout --model DIR --port 0` as a real process (the short flags)."""
    env = cpu_env({**os.environ, "PYTHONUNBUFFERED": "1"})
    cmd = [
        sys.executable,
        "-m",
        "services.rollout",
        "--model",
        str(tiny_qwen3),
        "--port",
        "0",
        "--vllm.dtype",
        "float32",
        "--vllm.enforce_eager",
        "--vllm.kv_cache_memory_bytes",
        str(64 << 20),
        "--vllm.max_model_len",
        "256",
        "--server.log_level",
        "warning",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        url = None
        deadline = time.monotonic() + 120
        while url is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                break
            if line.startswith("molt-rollout ready "):
                url = line.split()[-1]
        assert url, f"pod did not start (rc={proc.poll()})"
        r = httpx.post(
            f"{url}/v1/generate", json={"prompt_token_ids": PROMPT, "sampling_params": {"max_tokens": 4}}, timeout=30
        )
        assert r.status_code == 200 and len(r.json()["outputs"][0]["token_ids"]) == 4
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
