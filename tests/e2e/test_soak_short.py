"""The soak's short version (bench/soak.py): the tiny recipe's stack trained while the rollout pod, Redis, the env
worker, the gateway and the trainer are each SIGKILLed (by process group) and restarted once, each fault
fired by training progress (one per step). Every prompt is trained exactly once, no trajectory twice, all steps
are done, staleness stays within --train.async_queue_size, and no request got a 500."""

import sys

import pytest

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
    assert summary["failure"] is None, summary["failure"]
    assert [e["killed"] for e in summary["events"] if "killed" in e] == FAULTS, summary["events"]
    assert not [e for e in summary["events"] if "exited" in e], summary["events"]  # no exit we did not cause
    assert summary["steps_done"] == summary["steps_requested"] == STEPS
    assert summary["prompts_trained_once"] == summary["prompts_expected"] == STEPS * soak.PROMPTS_PER_STEP, summary
    assert summary["prompts_trained_twice_or_more"] == summary["prompts_never_trained"] == 0, summary
    assert summary["prompts_trained_out_of_order"] == 0, summary
    assert summary["trajectories_trained_twice"] == summary["trajectories_not_audited"] == 0, summary
    assert summary["staleness_max"] <= 2, summary  # the tiny recipe's --train.async_queue_size
    assert "500" not in summary["gateway_requests_by_code"], summary["gateway_requests_by_code"]
    assert set(summary["rss_mib"]) == set(soak.SERVICES)
