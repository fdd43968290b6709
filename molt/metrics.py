"""One observability contract for every service.

Metric names follow ``molt_<service>_<quantity>_<unit>``. This module is the catalog: each service
creates its metrics from these names on its own ``CollectorRegistry`` (one per app instance; no
module-level singletons), and the Grafana dashboard and the PrometheusRule alerts in deploy/k8s query
only names listed here. ``tests/integration/test_deploy_metrics.py`` scrapes the running services and
checks that every queried name and label exists.

Labels shared across services: ``rollout_url`` (the rollout pod a gateway, trainer or weight-sync series is
about; never ``pod``, which Kubernetes and Prometheus set to the scraped pod), ``policy_version``-like values
are exported as gauges, never as labels (unbounded cardinality). ``molt_build_info`` (version, revision,
python) is on every service.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass
from typing import Any, Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.utils import floatToGoString

Kind = Literal["counter", "gauge", "histogram"]

# Latency buckets tuned for a loopback proxy: sub-millisecond to seconds.
LATENCY_BUCKETS_S = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
DURATION_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32)
# Non-negative bounds on purpose: prometheus_client drops a histogram's _sum when any bound is
# negative, and the dashboard needs _sum/_count for mean reward. Negative rewards land in le="0".
REWARD_BUCKETS = (0, 0.1, 0.25, 0.5, 0.75, 0.9, 1, 2, 5)
# Logprob differences: exact (0) and float32 rounding up to a distribution that changed.
LOGPROB_GAP_BUCKETS = (0, 1e-6, 1e-5, 1e-4, 1e-3, 0.01, 0.03, 0.1, 0.3, 1)


@dataclass(frozen=True)
class MetricSpec:
    name: str
    kind: Kind
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] | None = None


def _m(name: str, kind: Kind, help: str, labels: tuple[str, ...] = (), buckets=None) -> MetricSpec:
    return MetricSpec(name, kind, help, labels, buckets)


CATALOG: dict[str, MetricSpec] = {
    s.name: s
    for s in [
        # ---- every service (Metrics adds it): which build runs, by the usual *_build_info convention
        _m(
            "molt_build_info",
            "gauge",
            "Always 1; the labels name the running build.",
            ("version", "revision", "python"),
        ),
        # ---- trajectory queue (exported by whoever owns a TrajectoryQueue: gateway and trainer)
        _m("molt_queue_length_entries", "gauge", "Entries in the trajectory stream (XLEN).", ("stream",)),
        _m(
            "molt_queue_pending_entries",
            "gauge",
            "Entries delivered to the consumer group and not yet acked.",
            ("stream",),
        ),
        _m("molt_queue_undelivered_entries", "gauge", "Entries not yet delivered to the consumer group.", ("stream",)),
        _m("molt_queue_oldest_unacked_age_seconds", "gauge", "Age of the oldest entry not yet acked.", ("stream",)),
        _m("molt_queue_dead_letter_total", "counter", "Records moved to the dead-letter stream.", ("stream",)),
        _m(
            "molt_queue_backpressure_wait_seconds_total",
            "counter",
            "Time producers waited on a full stream.",
            ("stream",),
        ),
        # ---- rollout pod
        _m("molt_rollout_requests_total", "counter", "Generate requests by outcome.", ("status",)),
        _m("molt_rollout_generated_tokens_total", "counter", "Tokens generated."),
        _m("molt_rollout_prompt_tokens_total", "counter", "Prompt tokens processed."),
        _m("molt_rollout_running_requests", "gauge", "Requests the engine is running."),
        _m("molt_rollout_waiting_requests", "gauge", "Requests waiting in the engine queue."),
        _m("molt_rollout_kv_cache_usage_ratio", "gauge", "Fraction of the KV cache in use."),
        _m("molt_rollout_policy_version", "gauge", "Policy version the pod serves."),
        _m(
            "molt_rollout_weight_apply_seconds",
            "histogram",
            "Pause-to-resume time of a weight application.",
            buckets=DURATION_BUCKETS_S,
        ),
        _m(
            "molt_rollout_request_aborts_total",
            "counter",
            "Requests aborted (client gone or weight update).",
            ("reason",),
        ),
        # ---- weight sync (both ends)
        _m("molt_weightsync_bytes_total", "counter", "Weight bytes moved.", ("side", "transport")),
        _m(
            "molt_weightsync_phase_seconds",
            "histogram",
            "Seconds per weight-sync phase.",
            ("side", "phase"),
            DURATION_BUCKETS_S,
        ),
        _m("molt_weightsync_failures_total", "counter", "Failed or aborted syncs.", ("side", "reason")),
        _m("molt_weightsync_version", "gauge", "Last version synced successfully.", ("side",)),
        _m(
            "molt_weightsync_check_max_abs_diff",
            "gauge",
            "Max |pod - trainer| probe logprob difference of the last verified sync.",
            ("rollout_url",),
        ),
        _m(
            "molt_weightsync_check_failures_total",
            "counter",
            "Syncs refused promotion by the weight check.",
            ("rollout_url",),
        ),
        # ---- gateway
        _m("molt_gateway_requests_total", "counter", "Requests by wire and status code.", ("wire", "code")),
        _m(
            "molt_gateway_added_latency_seconds",
            "histogram",
            "Time the gateway adds to a request (accept to response, minus time waiting on the pod).",
            ("wire",),
            LATENCY_BUCKETS_S,
        ),
        _m(
            "molt_gateway_request_seconds",
            "histogram",
            "Total request time from accept.",
            ("wire",),
            DURATION_BUCKETS_S,
        ),
        _m("molt_gateway_open_sessions", "gauge", "Open sessions."),
        _m("molt_gateway_sessions_total", "counter", "Sessions ended, by outcome.", ("outcome",)),
        _m(
            "molt_gateway_sessions_adopted_total",
            "counter",
            "Open sessions taken over from a replica that exited (parked in Redis).",
        ),
        _m("molt_gateway_trajectories_written_total", "counter", "Trajectories written to the stream."),
        _m("molt_gateway_trajectory_bytes_total", "counter", "Encoded trajectory bytes written."),
        _m(
            "molt_gateway_write_retries_total",
            "counter",
            "Finished trajectories' writes tried again: Redis unreachable, or the stream full.",
        ),
        _m("molt_gateway_errors_total", "counter", "Error responses by status code.", ("code",)),
        _m("molt_gateway_pod_inflight_requests", "gauge", "Requests in flight per rollout pod.", ("rollout_url",)),
        _m("molt_gateway_pod_healthy", "gauge", "1 if the pod passes health checks.", ("rollout_url",)),
        _m("molt_gateway_pod_failovers_total", "counter", "Sessions moved off a failed pod.", ("rollout_url",)),
        _m("molt_gateway_segments_total", "counter", "Segments started (first turn or history rewrite).", ("reason",)),
        _m(
            "molt_gateway_prompts_truncated_total",
            "counter",
            "Env first observations left-truncated to leave room to generate (truncate_prompt).",
        ),
        _m(
            "molt_gateway_rescored_segments_total",
            "counter",
            "Segments whose action logprobs were re-read by a prefill pass (--rollout.rescore_logprobs).",
        ),
        _m(
            "molt_gateway_rescore_kept_segments_total",
            "counter",
            "Segments that kept their decode logprobs under --rollout.rescore_logprobs, by reason.",
            ("reason",),
        ),
        _m(
            "molt_gateway_rescore_max_abs_diff",
            "histogram",
            "Largest |decode - prefill| action-token logprob difference of each rescored segment.",
            buckets=LOGPROB_GAP_BUCKETS,
        ),
        # ---- env workers
        _m("molt_envs_episodes_total", "counter", "Episodes by agent and status.", ("agent", "status")),
        _m("molt_envs_episode_seconds", "histogram", "Episode wall time.", ("agent",), DURATION_BUCKETS_S),
        _m("molt_envs_reward", "histogram", "Episode rewards.", ("agent",), REWARD_BUCKETS),
        _m("molt_envs_inflight_episodes", "gauge", "Episodes running now."),
        _m("molt_envs_rejected_total", "counter", "Episodes refused with 429 (worker saturated)."),
        _m(
            "molt_envs_event_loop_stalls_total",
            "counter",
            "Times synchronous agent code held the event loop past --envs.stall_warn_s, by the agent that held it.",
            ("agent",),
        ),
        # ---- trainer
        _m("molt_trainer_step", "gauge", "Optimizer steps completed."),
        _m("molt_trainer_policy_version", "gauge", "Policy version of the trainer's weights."),
        _m("molt_trainer_step_seconds", "histogram", "Seconds per step phase.", ("phase",), DURATION_BUCKETS_S),
        _m("molt_trainer_tokens_per_second", "gauge", "Trained tokens per second over the last step."),
        _m("molt_trainer_reward_mean", "gauge", "Mean reward of the last step's trajectories."),
        _m("molt_trainer_loss", "gauge", "Loss terms of the last step.", ("term",)),
        _m("molt_trainer_entropy", "gauge", "Mean token entropy of the last step."),
        _m("molt_trainer_clip_fraction", "gauge", "PPO clip fraction of the last step."),
        _m("molt_trainer_grad_norm", "gauge", "Gradient norm of the last step."),
        _m(
            "molt_trainer_mismatch_kl",
            "gauge",
            "Rollout-vs-trainer logprob KL (Molt's vllm_kl) by rollout pod, staleness included: tokens sampled by "
            "older policy versions count against the trainer's current pi_old.",
            ("rollout_url",),
        ),
        _m(
            "molt_trainer_mismatch_kl_fresh",
            "gauge",
            "Engine-vs-trainer logprob KL on fresh tokens only (sampled by the weights being trained): numerics, "
            "free of staleness. Kept from the last step that had fresh tokens.",
        ),
        _m("molt_trainer_is_filter_ratio", "gauge", "Fraction of tokens/sequences filtered by IS correction."),
        _m(
            "molt_trainer_staleness_versions",
            "histogram",
            "Trainer version minus a token's policy version.",
            buckets=STALENESS_BUCKETS,
        ),
        _m("molt_trainer_trajectories_total", "counter", "Trajectories consumed, by outcome.", ("outcome",)),
        _m("molt_trainer_bus_retries_total", "counter", "Stream calls retried through an outage of the bus."),
    ]
}


class _LoopChild:
    """One label set of a ``LoopSeries``: plain numbers, no lock."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one: above every bound (+Inf)
        self.sum = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.sum += amount

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value


class LoopSeries:
    """A counter or histogram for code that runs on one thread only (an asyncio event loop): ``labels(...)``,
    ``inc`` and ``observe`` as prometheus_client's, on plain numbers without its lock and per-call checks
    (a few us instead of ~15 per request for the gateway's three per-request series), exported on scrape."""

    def __init__(self, spec: MetricSpec, registry: CollectorRegistry) -> None:
        self.spec = spec
        self.bounds = (
            tuple(float(b) for b in (spec.buckets or Histogram.DEFAULT_BUCKETS) if b != float("inf"))
            if spec.kind == "histogram"
            else ()
        )
        self.children: dict[tuple[str, ...], _LoopChild] = {}
        if not spec.labels:  # exported from the start, at 0, as prometheus_client does
            self.children[()] = _LoopChild(self.bounds)
        registry.register(self)

    def inc(self, amount: float = 1.0) -> None:
        """An unlabelled counter's ``inc``."""
        self.labels().inc(amount)

    def observe(self, value: float) -> None:
        """An unlabelled histogram's ``observe``."""
        self.labels().observe(value)

    def labels(self, *values: str) -> _LoopChild:
        if len(values) != len(self.spec.labels):
            raise ValueError(f"{self.spec.name} takes labels {self.spec.labels}, got {values}")
        child = self.children.get(values)
        if child is None:
            child = self.children[values] = _LoopChild(self.bounds)
        return child

    def collect(self):
        spec = self.spec
        if spec.kind == "counter":
            counter = CounterMetricFamily(spec.name, spec.help, labels=spec.labels)
            for values, child in list(self.children.items()):
                counter.add_metric(values, child.sum)
            yield counter
            return
        family = HistogramMetricFamily(spec.name, spec.help, labels=spec.labels)
        for values, child in list(self.children.items()):
            running, buckets = 0, []
            for bound, n in zip((*self.bounds, float("inf")), child.counts):
                running += n
                buckets.append((floatToGoString(bound), running))
            family.add_metric(values, buckets, child.sum)
        yield family

    def describe(self):
        return []


def build_info() -> dict[str, str]:
    """Labels of ``molt_build_info``: the installed molt-services version, the source revision the image was
    built from (``MOLT_BUILD_REVISION``, a Docker build arg; "unknown" outside images) and the Python version."""
    import os
    import platform
    from importlib.metadata import PackageNotFoundError, version

    try:
        molt_version = version("molt-services")
    except PackageNotFoundError:  # running from a source tree that was never installed
        molt_version = "unknown"
    return {
        "version": molt_version,
        "revision": os.environ.get("MOLT_BUILD_REVISION") or "unknown",
        "python": platform.python_version(),
    }


class Metrics:
    """The metrics one app instance exports, created by name from the catalog on a private registry.

    Names in ``loop_local`` become ``LoopSeries`` (counters and histograms only): cheaper, and to be touched
    from one thread only."""

    def __init__(
        self,
        names: list[str] | tuple[str, ...],
        registry: CollectorRegistry | None = None,
        loop_local: tuple[str, ...] = (),
    ) -> None:
        self.registry = registry or CollectorRegistry()
        self._metrics: dict[str, Any] = {}  # a prometheus_client metric or a LoopSeries: both have .labels
        self._children: dict[tuple[str, ...], object] = {}
        names = ["molt_build_info", *(n for n in names if n != "molt_build_info")]  # every service says its build
        for name in names:
            spec = CATALOG[name]
            base = name[: -len("_total")] if spec.kind == "counter" and name.endswith("_total") else name
            if name in loop_local:
                if spec.kind == "gauge":
                    raise ValueError(f"{name}: a gauge cannot be loop-local")
                self._metrics[name] = LoopSeries(spec, self.registry)
                continue
            metric: Counter | Gauge | Histogram
            if spec.kind == "counter":
                metric = Counter(base, spec.help, spec.labels, registry=self.registry)
            elif spec.kind == "gauge":
                metric = Gauge(base, spec.help, spec.labels, registry=self.registry)
            else:
                metric = Histogram(
                    base,
                    spec.help,
                    spec.labels,
                    registry=self.registry,
                    buckets=spec.buckets or Histogram.DEFAULT_BUCKETS,
                )
            self._metrics[name] = metric
        self._metrics["molt_build_info"].labels(**build_info()).set(1)

    def __getitem__(self, name: str):
        return self._metrics[name]

    def child(self, name: str, *labels: str):
        """``self[name].labels(*labels)``, looked up once: prometheus_client's ``.labels()`` validates the values
        and takes a lock on every call, too slow for a per-request path with a few label sets."""
        key = (name, *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self._metrics[name].labels(*labels)
        return child

    def render(self) -> tuple[bytes, str]:
        """Prometheus text exposition of this registry and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def service_names(prefix: str) -> list[str]:
    """All catalog names of one service, e.g. ``service_names("molt_gateway_")``."""
    return [n for n in CATALOG if n.startswith(prefix)]
