"""The operators' push CLI against a real rollout pod (vLLM, tiny model, fp32): ``--check`` loads the pushed model
with transformers, and the pod commits the new weights only when its probe agrees; with a bound the probe cannot
meet, the pod refuses and rolls back, and keeps serving the weights it had (docs/weightsync.md, "Operators: push a
checkpoint to a running fleet")."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import pytest

from molt.net import free_port
from molt.weightsync.check import prompt_logprobs
from tests.gateway_testlib import ROOT, start_rollout_pod, stop

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

PROBE = [1, 17, 23, 42, 7, 99, 5, 3, 64, 11]


@pytest.fixture(scope="module")
def pod(tiny_qwen3, tmp_path_factory):
    grpc = ["--grpc.port", str(free_port())]
    proc, url = start_rollout_pod(tiny_qwen3, tmp_path_factory.mktemp("push") / "pod.log", extra=grpc)
    try:
        ready = httpx.get(url + "/readyz", timeout=10).json()
        yield url, f"127.0.0.1:{ready['grpc_port']}"
    finally:
        stop(proc)


def _push(model, target: str, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "services.trainer.push", "--model", str(model), "--pods", target, *flags],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _served(url: str) -> tuple[list[float], int]:
    body = httpx.post(url + "/v1/prompt_logprobs", json={"token_ids": PROBE}, timeout=60).json()
    return body["logprobs"], body["policy_version"]


def _transformers(model_dir) -> list[float]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return prompt_logprobs(model, PROBE)


def test_a_checked_push_commits_and_an_unmeetable_check_rolls_back(pod, tiny_qwen3, tiny_qwen3_b):
    url, target = pod
    before, version = _served(url)
    done = _push(tiny_qwen3_b, target, "--check")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["ok"] and report["version"] == version + 1 and not report["failed"]
    served, now = _served(url)
    assert now == version + 1
    assert max(abs(a - b) for a, b in zip(served, _transformers(tiny_qwen3_b))) < 1e-3
    assert max(abs(a - b) for a, b in zip(served, before)) > 1e-2  # other weights indeed

    # A bound no engine meets against transformers (fp32 kernels differ in the last bits): the pod refuses the
    # sync after loading it, restores the weights it served, and the CLI exits 1 with the report naming the pod.
    refused = _push(tiny_qwen3, target, "--check", "--check_max_abs_diff", "1e-12")
    assert refused.returncode == 1, refused.stderr
    report = json.loads(refused.stdout)
    assert not report["ok"] and target in report["failed"], report
    assert _served(url) == (served, now)
