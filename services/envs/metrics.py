"""Env-worker metrics: the ``molt_envs_*`` names of the catalog, on a registry per app instance."""

from __future__ import annotations

from prometheus_client import Counter

from molt.metrics import Metrics, service_names

STALLS = "molt_envs_event_loop_stalls_total"


def envs_metrics() -> Metrics:
    return Metrics(service_names("molt_envs_"))


def stall_counter(metrics: Metrics) -> Counter:
    """``molt_envs_event_loop_stalls_total{agent}``, for the loop watchdog: a prometheus_client counter (it takes a
    lock), so another thread may count on it."""
    counter = metrics[STALLS]
    assert isinstance(counter, Counter)
    return counter
