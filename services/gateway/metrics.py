"""Gateway metrics (catalog names only) and the ASGI middleware that times every request from accept."""

from __future__ import annotations

import time
from typing import Callable

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


class Telemetry:
    """Pure ASGI middleware: request counts by code, total time, and gateway-added time.

    Added time = accept to last body byte, minus ``scope["state"]["pod_wait_s"]`` (set by handlers to
    the time spent waiting on the rollout pod). Also stamps ``x-molt-policy-version`` on every response
    and, on turns, ``server-timing: gateway;dur=MS, pod;dur=MS`` (accept to response start).
    """

    def __init__(self, app, metrics: Metrics, policy_version: Callable[[], int]) -> None:
        self.app = app
        self.metrics = metrics
        self.policy_version = policy_version
        self.requests = metrics["molt_gateway_requests_total"]
        self.errors = metrics["molt_gateway_errors_total"]
        self.added = metrics["molt_gateway_added_latency_seconds"]
        self.total = metrics["molt_gateway_request_seconds"]
        # prometheus_client's .labels() validates and locks on every call; the label sets are few, so the
        # children are looked up once per (path, status) and kept.
        self._children: dict[tuple[str, int], tuple] = {}

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        path = scope["path"]
        state = scope.setdefault("state", {})
        status = 500

        async def send_wrapper(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = list(message.get("headers", []))
                if not any(k == b"x-molt-policy-version" for k, _ in headers):
                    headers.append((b"x-molt-policy-version", str(self.policy_version()).encode()))
                if "pod_wait_s" in state:  # a turn: say how the time split (standard Server-Timing header)
                    total_ms = (time.perf_counter() - t0) * 1e3
                    pod_ms = state["pod_wait_s"] * 1e3
                    headers.append((b"server-timing",
                                    f"gateway;dur={total_ms - pod_ms:.3f}, pod;dur={pod_ms:.3f}".encode()))
                message = dict(message, headers=headers)
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                self._record(path, status, time.perf_counter() - t0, state.get("pod_wait_s", 0.0))

        await self.app(scope, receive, send_wrapper)

    def _record(self, path: str, status: int, total_s: float, pod_wait_s: float) -> None:
        if path in UNTIMED:
            return
        wire = wire_label(path)
        children = self._children.get((wire, status))
        if children is None:
            children = (self.requests.labels(wire, str(status)),
                        self.errors.labels(str(status)) if status >= 400 else None,
                        self.total.labels(wire), self.added.labels(wire))
            self._children[(wire, status)] = children
        requests, errors, total, added = children
        requests.inc()
        if errors is not None:
            errors.inc()
        total.observe(total_s)
        added.observe(max(0.0, total_s - pod_wait_s))
