"""Gateway metrics: the catalog names, and the labels the edge (services/gateway/edge.py) records under."""

from __future__ import annotations

from molt.bus import QUEUE_METRICS
from molt.metrics import Metrics, service_names

UNTIMED = ("/metrics", "/healthz", "/readyz")


def gateway_metrics() -> Metrics:
    return Metrics(service_names("molt_gateway_") + list(QUEUE_METRICS))


def wire_label(path: str) -> str:
    if path.endswith("/messages"):
        return "anthropic"
    if path.endswith("/completions"):
        return "openai"
    if path.endswith("/generate"):
        return "tokens"
    return "control"
