"""Start-up in any order: a trainer whose only rollout pod does not answer yet (Kubernetes starts pods in any order;
a restarted trainer may find its pod restarting too) waits for it with backoff, reporting not ready, and trains
the whole run once the pod is up; a pod that never comes up ends it after ``--rollout.startup_wait_s`` with one
line naming that flag.

Real Redis, a real trainer process, the real weight-sync gRPC server (recording engine) behind a pod /readyz that
starts late, and a real HTTP env worker (tests/integration/fleet_testlib.py).
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections import Counter

import httpx
import pytest

from molt.net import free_port
from tests.integration.fleet_testlib import Fleet
from tests.integration.trainer_testlib import ROOT, audit, delete_stream, env, grpo_run_flags, trainer_cmd

pytestmark = [pytest.mark.redis, pytest.mark.timeout(300)]
PROMPTS, N = 4, 2


def _flags(model, redis_url, stream, dataset, envs_url, pod_url, audit_path) -> list[str]:
    return [
        "--actor.model_name_or_path",
        str(model),
        "--redis.url",
        redis_url,
        "--redis.stream",
        stream,
        "--data.prompt_dataset",
        str(dataset),
        "--data.input_key",
        "question",
        "--envs.urls",
        envs_url,
        "--rollout.urls",
        pod_url,
        *grpo_run_flags(N, PROMPTS),
        "--ckpt.path",  # its final model goes next to it, not into the working directory
        str(audit_path.parent / "ckpt" / "checkpoints"),
        "--fsdp.strategy",
        "torch",
        "--logger.steps_jsonl",
        str(audit_path),
        "--server.port",
        "0",
    ]


def _wait(pred, what: str, proc: subprocess.Popen, log_path, timeout_s: float = 120):
    deadline = time.monotonic() + timeout_s
    while not (found := pred()):
        assert proc.poll() is None, f"the trainer exited {proc.returncode} waiting for {what}:\n{log_path.read_text()}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}:\n{log_path.read_text()[-3000:]}"
        time.sleep(0.1)
    return found


def test_trainer_waits_not_ready_for_a_pod_that_starts_after_it(tiny_qwen3, redis_url, stream_name, tmp_path):
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text("".join(json.dumps({"question": f"q{i}"}) + "\n" for i in range(PROMPTS)))
    audit_path, log_path = tmp_path / "audit.jsonl", tmp_path / "trainer.log"
    fleet = Fleet(tiny_qwen3, redis_url, stream_name)
    pod_port = free_port()
    flags = _flags(tiny_qwen3, redis_url, stream_name, dataset, fleet.url, f"http://127.0.0.1:{pod_port}", audit_path)
    try:
        with open(log_path, "w") as log:
            trainer = subprocess.Popen(
                trainer_cmd() + flags, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env()
            )
        listening = re.compile(r"trainer listening on (http://\S+)")
        url = _wait(lambda: listening.search(log_path.read_text()), "its port", trainer, log_path).group(1)
        _wait(lambda: "waiting for it" in log_path.read_text(), "the pod", trainer, log_path)
        answer = httpx.get(url + "/readyz")
        assert (answer.status_code, answer.json()["phase"]) == (503, "waiting_for_pods")
        fleet.serve_pod_http(0, pod_port)  # the pod's engine is loaded: its /readyz answers now
        assert trainer.wait(180) == 0, log_path.read_text()[-4000:]
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
        fleet.close()
        delete_stream(redis_url, stream_name)
    entries = audit(audit_path)
    assert [e["step"] for e in entries] == list(range(1, PROMPTS + 1))
    assert fleet.pods[0].applied == list(range(PROMPTS + 1))  # pushed before the first dispatch, then each step
    trained = Counter(t for e in entries for t in e["trajectory_ids"])
    assert set(trained.values()) == {1}
    assert Counter(fleet.written[t][2] for t in trained) == {f"q{i}": N for i in range(PROMPTS)}


def test_trainer_exits_with_one_line_naming_the_flag_when_its_pod_never_answers(
    tiny_qwen3, redis_url, stream_name, tmp_path
):
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text(json.dumps({"question": "q0"}) + "\n")
    pod_url = f"http://127.0.0.1:{free_port()}"
    flags = _flags(tiny_qwen3, redis_url, stream_name, dataset, pod_url, pod_url, tmp_path / "audit.jsonl")
    proc = subprocess.run(
        trainer_cmd() + [*flags, "--rollout.startup_wait_s", "2"],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("python -m services.trainer: error: rollout pod " + pod_url), proc.stderr[-3000:]
    assert "--rollout.startup_wait_s 2" in last and "Traceback" not in proc.stderr
