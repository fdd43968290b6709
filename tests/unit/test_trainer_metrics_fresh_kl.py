"""The trainer exports the fresh-token mismatch KL (engine-vs-trainer numerics) apart from the
staleness-inclusive per-pod KL, and keeps the last measurement through steps without fresh tokens."""

from __future__ import annotations

from services.trainer.metrics import record_step, trainer_metrics


def _value(m, name: str, labels: dict | None = None) -> float | None:
    return m.registry.get_sample_value(name, labels or {})


def test_fresh_kl_is_exported_and_kept_through_steps_without_fresh_tokens():
    m = trainer_metrics()
    stats = {"mismatch_kl": {"http://pod-0:8000": 0.178}, "mismatch_kl_fresh": 1.8e-3}
    record_step(m, 1, 1, stats, tokens=10, seconds=1.0, rewards=[1.0], staleness={2: 10})
    assert _value(m, "molt_trainer_mismatch_kl_fresh") == 1.8e-3
    assert _value(m, "molt_trainer_mismatch_kl", {"rollout_url": "http://pod-0:8000"}) == 0.178
    # a step whose tokens all came from older versions measures no fresh KL (NaN): the gauge keeps 1.8e-3
    record_step(
        m,
        2,
        2,
        {"mismatch_kl": {"http://pod-0:8000": 0.2}, "mismatch_kl_fresh": float("nan")},
        tokens=10,
        seconds=1.0,
        rewards=[1.0],
        staleness={3: 10},
    )
    assert _value(m, "molt_trainer_mismatch_kl_fresh") == 1.8e-3
