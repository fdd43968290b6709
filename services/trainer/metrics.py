"""The trainer's Prometheus metrics (catalog names ``molt_trainer_*`` and ``molt_queue_*``).

One ``Metrics`` per trainer process on its own registry. ``record_step`` maps a learner step's
metrics (Molt's keys) onto the catalog names; phases of the step loop are timed with
``phase(name)``.
"""

from __future__ import annotations

import contextlib
import time

from molt.bus import QUEUE_METRICS
from molt.metrics import Metrics, service_names

LOSS_TERMS = ("policy_loss", "kl_loss", "entropy_loss", "value_loss")


def trainer_metrics() -> Metrics:
    return Metrics(service_names("molt_trainer_") + list(QUEUE_METRICS))


@contextlib.contextmanager
def phase(metrics: Metrics, name: str, timings: dict[str, float] | None = None):
    start = time.perf_counter()
    try:
        yield
    finally:
        elapsed = time.perf_counter() - start
        metrics["molt_trainer_step_seconds"].labels(name).observe(elapsed)
        if timings is not None:
            timings[name] = timings.get(name, 0.0) + elapsed


def observe_many(hist, value: float, count: int) -> None:
    """``count`` observations of ``value`` in O(buckets): the staleness histogram gets one per action token.
    Uses prometheus_client's bucket storage when present (same effect as ``observe`` called count times)."""
    bounds, buckets, total = (getattr(hist, a, None) for a in ("_upper_bounds", "_buckets", "_sum"))
    if bounds is None or buckets is None or total is None:
        for _ in range(count):
            hist.observe(value)
        return
    for i, bound in enumerate(bounds):
        if value <= bound:
            buckets[i].inc(count)
            break
    total.inc(value * count)


def record_step(
    m: Metrics,
    step: int,
    version: int,
    stats: dict,
    *,
    tokens: int,
    seconds: float,
    rewards: list[float],
    staleness: dict[int, int],
) -> None:
    m["molt_trainer_step"].set(step)
    m["molt_trainer_policy_version"].set(version)
    m["molt_trainer_tokens_per_second"].set(tokens / seconds if seconds > 0 else 0.0)
    if rewards:
        m["molt_trainer_reward_mean"].set(sum(rewards) / len(rewards))
    for term in LOSS_TERMS:
        if term in stats:
            m["molt_trainer_loss"].labels(term).set(stats[term])
    m["molt_trainer_entropy"].set(stats.get("entropy", 0.0))
    m["molt_trainer_clip_fraction"].set(stats.get("policy_clip_ratio", 0.0))
    m["molt_trainer_grad_norm"].set(stats.get("actor_grad_norm", 0.0))
    if "is_filter_ratio" in stats:
        m["molt_trainer_is_filter_ratio"].set(stats["is_filter_ratio"])
    for pod, kl in stats.get("mismatch_kl", {}).items():
        m["molt_trainer_mismatch_kl"].labels(pod).set(kl)
    # NaN when no token of this step came from the current weights (deep async): keep the last measurement
    # rather than export NaN, which would reset a pending alert on every such step.
    fresh = stats.get("mismatch_kl_fresh", float("nan"))
    if fresh == fresh:
        m["molt_trainer_mismatch_kl_fresh"].set(fresh)
    hist = m["molt_trainer_staleness_versions"]
    for value, count in staleness.items():
        observe_many(hist, value, count)
