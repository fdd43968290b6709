"""Gateway metrics: the catalog names, and the labels the edge (services/gateway/edge.py) records under."""

from __future__ import annotations

from molt.bus import QUEUE_METRICS
from molt.metrics import CATALOG, Metrics, service_names

UNTIMED = ("/metrics", "/healthz", "/readyz")


def gateway_metrics() -> Metrics:
    """The gateway's series. Its counters and histograms are recorded per request or per session, and only on
    its event loop: they are lock-free (``molt.metrics.LoopSeries``)."""
    names = service_names("molt_gateway_")
    return Metrics(names + list(QUEUE_METRICS), loop_local=tuple(n for n in names if CATALOG[n].kind != "gauge"))


def wire_label(path: str) -> str:
    if path.endswith("/messages"):
        return "anthropic"
    if path.endswith("/completions") or path.endswith("/responses"):
        return "openai"
    if path.endswith("/generate"):
        return "tokens"
    return "control"
