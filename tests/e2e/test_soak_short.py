"""The soak's short version (bench/soak.py): the tiny recipe's stack trained while the rollout pod, Redis, the env
worker, the gateway and the trainer are each SIGKILLed (by process group) and restarted once, each fault
fired by training progress (one per step). Every prompt is trained exactly once, no trajectory twice, all steps
are done, staleness stays within --train.async_queue_size, and no request got a 500."""

import sys

import pytest

from tests.e2e.soak_checks import assert_soak_kept_its_promise

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.vllm, pytest.mark.serial, pytest.mark.timeout(900)]
FAULTS = ["pod", "redis", "envs", "gateway", "trainer"]
STEPS = 9


def test_every_service_killed_once_loses_and_doubles_nothing(tmp_path, monkeypatch):
    from bench import soak

    monkeypatch.setattr(sys, "argv", ["soak"])
    # Every wait of the run is bounded (a restart by --ready-s, a step by --stall-s, all by --minutes): a run
    # that hits one stops and names it in "failure" well inside this test's timeout.
    summary = soak.main(
        [
            # The pod first: the steps after its restart need its rollouts, which must come at the trainer's
            # version (a pod on its base weights would train at a staleness past the bound).
            # Steps to spare: while a service is down the trainer may run up to --train.async_queue_size steps
            # ahead on rollouts already queued, and the next fault waits for the previous service to be back.
            *("--steps", str(STEPS), "--fault-every-steps", "1", "--down-s", "2", "--faults", ",".join(FAULTS)),
            *("--fault-rounds", "1"),
            *("--minutes", "9", "--ready-s", "180", "--stall-s", "180"),
            *("--run-dir", str(tmp_path / "soak")),
            # Without torch.compile a restarted pod is back in seconds, not a minute, on 2 cores.
            "--pod-arg=--vllm.enforce_eager",
        ]
    )
    assert_soak_kept_its_promise(summary, STEPS, FAULTS)
