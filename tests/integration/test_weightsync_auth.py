"""Only the holder of MOLT_WEIGHTS_TOKEN changes a real pod's weights (gRPC push and HTTP reload).

One real pod process (``python -m services.rollout`` with a token, HTTP + gRPC on loopback). Pushes
and reloads without the token or with a wrong one are refused (UNAUTHENTICATED / 401) and leave the
pod's version and a greedy generate's tokens exactly as they were; with the token, the same push by
``python -m services.trainer.push`` (gRPC and the gloo collective path) and the same reload go through.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import pytest
from rollout_testlib import PROMPT

from molt._proto import weightsync_pb2 as pb
from molt.net import free_port
from molt.weightsync.client import GrpcPodClient, PodError
from molt.weightsync.pusher import WeightPusher, WeightPushError
from services.trainer.push import load_model_dir

pytestmark = [pytest.mark.timeout(300), pytest.mark.vllm]
TOKEN = "s3cret-weights-token"
GREEDY = {"prompt_token_ids": PROMPT, "sampling_params": {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True}}


def _start_pod(model, env: dict, *flags: str) -> tuple[subprocess.Popen, str | None]:
    cmd = [
        sys.executable,
        "-m",
        "services.rollout",
        "--model",
        str(model),
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
        *flags,
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith("molt-rollout ready "):
            return proc, line.split()[-1]
        if not line and proc.poll() is not None:
            break
    return proc, None


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(30)


@pytest.fixture(scope="module")
def pod(tiny_qwen3):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "MOLT_WEIGHTS_TOKEN": TOKEN}
    proc, url = _start_pod(tiny_qwen3, env, "--grpc.port", str(free_port()))
    try:
        assert url, f"pod did not start: {proc.stderr.read() if proc.poll() is not None else ''}"
        yield url, f"127.0.0.1:{httpx.get(f'{url}/readyz').json()['grpc_port']}"
    finally:
        _stop(proc)


def _observe(url: str) -> tuple[int, list[int]]:
    version = httpx.get(f"{url}/readyz").json()["policy_version"]
    r = httpx.post(f"{url}/v1/generate", json=GREEDY, timeout=60)
    assert r.status_code == 200, r.text
    return version, r.json()["outputs"][0]["token_ids"]


async def test_pushes_and_reloads_without_the_token_change_nothing(pod, tiny_qwen3_b):
    url, target = pod
    before = _observe(url)
    tensors, tie = load_model_dir(tiny_qwen3_b)
    for token in ("", "wrong-token"):  # "" sends no authorization header at all
        pusher = WeightPusher([target], tie_word_embeddings=tie, token=token)
        with pytest.raises(WeightPushError) as err:
            await pusher.push_async(tensors, version=before[0] + 1, force=True)
        assert "UNAUTHENTICATED" in str(err.value)
        await pusher._close_clients()
        client = GrpcPodClient(target, token=token)  # a raw Push stream, without Begin, is refused up front
        stream = client.open_push()
        with pytest.raises(PodError) as perr:
            await stream.write(b"\x00" * 64)
            await stream.done()
        assert perr.value.code == "UNAUTHENTICATED"
        with pytest.raises(PodError):
            await client.init_collective(
                pb.InitCollectiveRequest(
                    backend="gloo", master_addr="127.0.0.1", master_port=1, world_size=2, rank=1, timeout_s=1
                )
            )
        await client.close()
    body = {"path": str(tiny_qwen3_b), "version": before[0] + 1}
    for headers in ({}, {"Authorization": "Bearer wrong-token"}, {"Authorization": TOKEN}):
        r = httpx.post(f"{url}/v1/weights/reload", json=body, headers=headers, timeout=60)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", r.text
        assert r.headers["www-authenticate"] == "Bearer"
    assert _observe(url) == before


async def test_the_token_holder_pushes_and_reloads(pod, tiny_qwen3, tiny_qwen3_b):
    url, target = pod
    version, tokens_a = _observe(url)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MOLT_WEIGHTS_TOKEN": TOKEN}
    cli = subprocess.run(
        [sys.executable, "-m", "services.trainer.push", "--model", str(tiny_qwen3_b), "--pods", target],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert cli.returncode == 0, cli.stderr
    version_b, tokens_b = _observe(url)
    assert version_b == version + 1 and tokens_b != tokens_a
    r = httpx.post(
        f"{url}/v1/weights/reload",
        json={"path": str(tiny_qwen3), "version": version_b + 1},
        headers={"Authorization": f"Bearer {TOKEN}"},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    assert _observe(url) == (version_b + 1, tokens_a)
    status = await GrpcPodClient(target, token=TOKEN).status()
    assert status.version == version_b + 1
    gloo = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.trainer.push",
            "--model",
            str(tiny_qwen3_b),
            "--pods",
            target,
            "--transport",
            "gloo",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert gloo.returncode == 0, gloo.stderr  # the collective path, its gRPC control authenticated
    assert _observe(url) == (version_b + 2, tokens_b)
    wrong = subprocess.run(
        [sys.executable, "-m", "services.trainer.push", "--model", str(tiny_qwen3_b), "--pods", target],
        env={**env, "MOLT_WEIGHTS_TOKEN": "wrong"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert wrong.returncode != 0 and "UNAUTHENTICATED" in wrong.stderr
    assert _observe(url) == (version_b + 2, tokens_b)


def test_a_pod_on_a_public_address_without_a_token_refuses_to_start(tiny_qwen3):
    env = {k: v for k, v in os.environ.items() if k != "MOLT_WEIGHTS_TOKEN"}
    proc, url = _start_pod(tiny_qwen3, env, "--host", "0.0.0.0", "--grpc.port", "0")
    _stop(proc)
    assert url is None and proc.returncode != 0
    assert "set MOLT_WEIGHTS_TOKEN" in proc.stderr.read()
