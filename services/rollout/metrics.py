"""Rollout-pod metrics: the ``molt_rollout_*`` catalog names, refreshed from the engine at scrape time, followed by
vLLM's own engine metrics (``vllm:*``: time to first token, inter-token latency, queue time, prefix-cache hits,
preemptions...). vLLM's Prometheus stat logger records those in this process (the engine's frontend) on the
registry its own API server serves; /metrics appends that registry, as vLLM's /metrics would show it."""

from __future__ import annotations

from prometheus_client import generate_latest

from molt.metrics import Metrics, service_names
from services.rollout.engine import RolloutEngine


class RolloutMetrics:
    """Request counters are bumped by the routes; engine-side figures are pulled on every scrape."""

    def __init__(self) -> None:
        # The weight-sync receiver runs inside the pod and exports on the same registry.
        self.metrics = Metrics(service_names("molt_rollout_") + service_names("molt_weightsync_"))
        self._applies_seen = 0
        self._aborts_seen: dict[str, int] = {}

    def __getitem__(self, name: str):
        return self.metrics[name]

    def request_done(self, status: str, prompt_tokens: int = 0, generated_tokens: int = 0) -> None:
        self.metrics["molt_rollout_requests_total"].labels(status=status).inc()
        if prompt_tokens:
            self.metrics["molt_rollout_prompt_tokens_total"].inc(prompt_tokens)
        if generated_tokens:
            self.metrics["molt_rollout_generated_tokens_total"].inc(generated_tokens)

    def refresh(self, engine: RolloutEngine) -> None:
        m = self.metrics
        m["molt_rollout_running_requests"].set(engine.stats.running)
        m["molt_rollout_waiting_requests"].set(engine.stats.waiting)
        m["molt_rollout_kv_cache_usage_ratio"].set(engine.stats.kv_cache_usage)
        m["molt_rollout_policy_version"].set(engine.policy_version)
        applies = list(engine.weight_apply_s)
        for seconds in applies[self._applies_seen :]:  # weight applies also come from gRPC, not just routes
            m["molt_rollout_weight_apply_seconds"].observe(seconds)
        self._applies_seen = len(applies)
        for reason, count in dict(engine.aborts).items():
            delta = count - self._aborts_seen.get(reason, 0)
            if delta:
                m["molt_rollout_request_aborts_total"].labels(reason=reason).inc(delta)
            self._aborts_seen[reason] = count

    def render(self, engine: RolloutEngine) -> tuple[bytes, str]:
        self.refresh(engine)
        ours, content_type = self.metrics.render()
        return ours + vllm_engine_metrics(), content_type


def vllm_engine_metrics() -> bytes:
    """vLLM's engine metrics in text exposition: the registry vLLM's own /metrics serves (the process registry, or
    a multiprocess collector when PROMETHEUS_MULTIPROC_DIR is set)."""
    from vllm.v1.metrics.prometheus import get_prometheus_registry

    return generate_latest(get_prometheus_registry())
