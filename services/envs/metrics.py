"""Env-worker metrics: the ``molt_envs_*`` names of the catalog, on a registry per app instance."""

from __future__ import annotations

from molt.metrics import Metrics, service_names


def envs_metrics() -> Metrics:
    return Metrics(service_names("molt_envs_"))
