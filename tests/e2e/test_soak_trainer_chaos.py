"""Chaos on the real stack (bench/soak.py): the tiny recipe's trainer is SIGKILLed twice, each at a random
point of a step (collecting rollouts, training, saving, publishing weights), and restarted, while the real pod
(vLLM), gateway, env worker and Redis keep running. Every prompt is trained exactly once, no trajectory twice,
nothing is left unaudited, all steps are done and staleness stays within --train.async_queue_size.
(tests/integration/test_trainer_chaos.py kills the trainer three times, once inside its weight push, with a
recording pod and a synthetic env worker.)"""

import sys

import pytest

from tests.e2e.soak_checks import assert_soak_kept_its_promise

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(900)]
STEPS, KILLS = 6, 2  # longer runs: python bench/soak.py --faults trainer --fault-rounds N


def test_trainer_killed_at_random_points_trains_every_prompt_once(tmp_path, monkeypatch):
    from bench import soak

    monkeypatch.setattr(sys, "argv", ["soak"])
    summary = soak.main(
        [
            *("--steps", str(STEPS), "--faults", "trainer", "--fault-every-steps", "2"),
            *("--fault-rounds", str(KILLS), "--down-s", "1", "--fault-jitter-s", "2.5", "--seed", "3"),
            *("--minutes", "12", "--ready-s", "240", "--stall-s", "240"),
            *("--run-dir", str(tmp_path / "soak")),
            "--pod-arg=--vllm.enforce_eager",
        ]
    )
    assert_soak_kept_its_promise(summary, STEPS, ["trainer"] * KILLS)
