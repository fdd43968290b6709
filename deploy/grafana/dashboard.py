"""Build the Molt Grafana dashboard (deploy/k8s/molt/dashboards/molt-overview.json).

The panels are written here as (title, queries) so the PromQL reads as a list; the JSON is derived.
Edit this file, then run ``python deploy/grafana/dashboard.py`` (tests/unit/test_deploy_dashboard.py
fails while the committed JSON is out of date). Every molt_* name must be in molt/metrics.py CATALOG.

``{}`` after a metric name expands to the namespace selector, so one Prometheus can hold several
Molt deployments; in docker-compose the namespace label is absent and ``=~".*"`` still matches.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "k8s" / "molt" / "dashboards" / "molt-overview.json"
NS = '{namespace=~"$namespace"}'
RI = "[$__rate_interval]"


def q(expr: str, legend: str = "", **extra) -> dict:
    return {"expr": expr.replace("{}", NS).replace("[RI]", RI), "legendFormat": legend, **extra}


def quantiles(bucket: str, by: str, legend: str, qs=(0.5, 0.9)) -> list[dict]:
    """histogram_quantile at each q over ``bucket`` grouped by ``by`` (plus le)."""
    group = f"le, {by}" if by else "le"
    return [
        q(f"histogram_quantile({x}, sum by ({group}) (rate({bucket}{{}}[RI])))", f"p{int(x * 100)} {legend}")
        for x in qs
    ]


def mean(hist: str, by: str, legend: str) -> dict:
    agg = f"sum by ({by})" if by else "sum"
    return q(f"{agg} (rate({hist}_sum{{}}[RI])) / {agg} (rate({hist}_count{{}}[RI]))", legend)


# (row title, [(panel title, unit, kind, queries, description)])
ROWS: list[tuple[str, list[tuple]]] = [
    (
        "Trajectory queue",
        [
            (
                "Backlog",
                "short",
                "timeseries",
                [
                    q("max by (stream) (molt_queue_undelivered_entries{})", "{{stream}} undelivered"),
                    q("max by (stream) (molt_queue_pending_entries{})", "{{stream}} pending (delivered, not acked)"),
                    q("max by (stream) (molt_queue_length_entries{})", "{{stream}} length"),
                ],
                "Queue lag: entries the trainer has not received (undelivered) or not acked (pending).",
            ),
            (
                "Oldest unacked entry",
                "s",
                "timeseries",
                [
                    q("max by (stream) (molt_queue_oldest_unacked_age_seconds{})", "{{stream}}"),
                ],
                "Age of the oldest trajectory not yet acked by the trainer.",
            ),
            (
                "Trajectories per second",
                "ops",
                "timeseries",
                [
                    q("sum(rate(molt_gateway_trajectories_written_total{}[RI]))", "written (gateway)"),
                    q("sum by (outcome) (rate(molt_trainer_trajectories_total{}[RI]))", "consumed: {{outcome}}"),
                ],
                "Produced by the gateway vs consumed by the trainer.",
            ),
            (
                "Backpressure and dead letters",
                "short",
                "timeseries",
                [
                    q(
                        "sum by (stream) (rate(molt_queue_backpressure_wait_seconds_total{}[RI]))",
                        "{{stream}} producer wait (s/s)",
                    ),
                    q("sum by (stream) (increase(molt_queue_dead_letter_total{}[RI]))", "{{stream}} dead-lettered"),
                ],
                "Producers waiting on a full stream; records that failed to decode.",
            ),
            (
                "Trajectory bytes written",
                "Bps",
                "timeseries",
                [
                    q("sum(rate(molt_gateway_trajectory_bytes_total{}[RI]))", "encoded bytes/s"),
                ],
                "Encoded trajectory bytes the gateway writes to the stream (Redis memory and network).",
            ),
            (
                "Stream calls retried through a bus outage",
                "short",
                "timeseries",
                [
                    q("sum(increase(molt_gateway_write_retries_total{}[RI]))", "gateway writes/finishes"),
                    q("sum(increase(molt_trainer_bus_retries_total{}[RI]))", "trainer reads/acks"),
                ],
                "Non-zero while Redis is down or failing over: work waits instead of being lost.",
            ),
        ],
    ),
    (
        "Staleness and policy versions",
        [
            (
                "Staleness (versions) distribution",
                "short",
                "heatmap",
                [
                    q(
                        "sum by (le) (increase(molt_trainer_staleness_versions_bucket{}[RI]))",
                        "{{le}}",
                        format="heatmap",
                    ),
                ],
                "Trainer version minus the policy version each trained token was sampled with.",
            ),
            (
                "Staleness quantiles",
                "short",
                "timeseries",
                quantiles("molt_trainer_staleness_versions_bucket", "", "staleness", (0.5, 0.95))
                + [mean("molt_trainer_staleness_versions", "", "mean")],
                "",
            ),
            (
                "Policy versions",
                "short",
                "timeseries",
                [
                    q("max(molt_trainer_policy_version{})", "trainer"),
                    q("max by (pod) (molt_rollout_policy_version{})", "rollout {{pod}}"),
                    q("max by (side) (molt_weightsync_version{})", "last synced ({{side}})"),
                ],
                "Each rollout pod's version should follow the trainer's within a step or two.",
            ),
        ],
    ),
    (
        "Mismatch KL",
        [
            (
                "Engine-vs-trainer KL, fresh tokens (alerted)",
                "short",
                "kl",
                [
                    q("max(molt_trainer_mismatch_kl_fresh{})", "fresh tokens"),
                    q("max(molt_trainer_policy_version{})", "trainer policy version"),
                ],
                (
                    "KL on tokens sampled by the weights being trained: numerics (weights, dtype, kernels, template), "
                    "free of staleness. MoltMismatchKLFreshHigh watches this one."
                ),
            ),
            (
                "Mismatch KL per rollout pod, staleness included",
                "short",
                "kl",
                [
                    q("max by (rollout_url) (molt_trainer_mismatch_kl{})", "{{rollout_url}}"),
                    q("max(molt_trainer_policy_version{})", "trainer policy version"),
                ],
                (
                    "Rollout-vs-trainer logprob KL per pod over all trained tokens, stale ones included: grows with "
                    "async depth by design (not alerted); the right axis shows the policy version."
                ),
            ),
            (
                "Weight check |pod - trainer| logprob diff",
                "short",
                "timeseries",
                [
                    q("max by (rollout_url) (molt_weightsync_check_max_abs_diff{})", "{{rollout_url}}"),
                ],
                "Max probe logprob difference after the last verified sync.",
            ),
            (
                "IS-filtered fraction",
                "percentunit",
                "timeseries",
                [
                    q("max(molt_trainer_is_filter_ratio{})", "filtered"),
                ],
                "Tokens/sequences masked by importance-sampling correction.",
            ),
        ],
    ),
    (
        "Weight sync",
        [
            (
                "Phase time p90",
                "s",
                "timeseries",
                quantiles("molt_weightsync_phase_seconds_bucket", "side, phase", "{{side}} {{phase}}", (0.9,)),
                "",
            ),
            (
                "Phase time mean",
                "s",
                "timeseries",
                [
                    mean("molt_weightsync_phase_seconds", "side, phase", "{{side}} {{phase}}"),
                ],
                "",
            ),
            (
                "Rollout pause to apply weights",
                "s",
                "timeseries",
                quantiles("molt_rollout_weight_apply_seconds_bucket", "pod", "{{pod}}"),
                "Generation is paused meanwhile.",
            ),
            (
                "Bytes per second",
                "Bps",
                "timeseries",
                [
                    q("sum by (side, transport) (rate(molt_weightsync_bytes_total{}[RI]))", "{{side}} {{transport}}"),
                ],
                "",
            ),
            (
                "Failures",
                "short",
                "timeseries",
                [
                    q("sum by (side, reason) (increase(molt_weightsync_failures_total{}[RI]))", "{{side}} {{reason}}"),
                    q(
                        "sum by (rollout_url) (increase(molt_weightsync_check_failures_total{}[RI]))",
                        "check refused {{rollout_url}}",
                    ),
                ],
                "",
            ),
        ],
    ),
    (
        "Gateway",
        [
            (
                "Added latency",
                "s",
                "timeseries",
                quantiles("molt_gateway_added_latency_seconds_bucket", "wire", "{{wire}}", (0.5, 0.99)),
                "Time the gateway adds on top of the rollout pod.",
            ),
            (
                "Request time",
                "s",
                "timeseries",
                quantiles("molt_gateway_request_seconds_bucket", "wire", "{{wire}}", (0.5, 0.99)),
                "",
            ),
            (
                "Requests per second",
                "reqps",
                "timeseries",
                [
                    q("sum by (wire, code) (rate(molt_gateway_requests_total{}[RI]))", "{{wire}} {{code}}"),
                ],
                "",
            ),
            (
                "Errors per second",
                "reqps",
                "timeseries",
                [
                    q("sum by (code) (rate(molt_gateway_errors_total{}[RI]))", "{{code}}"),
                ],
                "",
            ),
            (
                "Sessions",
                "short",
                "timeseries",
                [
                    q("sum(molt_gateway_open_sessions{})", "open"),
                    q("sum by (outcome) (rate(molt_gateway_sessions_total{}[RI]))", "ended/s {{outcome}}"),
                    q(
                        "sum(rate(molt_gateway_sessions_adopted_total{}[RI]))",
                        "adopted/s (from a replica that exited)",
                    ),
                    q("sum by (reason) (rate(molt_gateway_segments_total{}[RI]))", "segments/s {{reason}}"),
                    q(
                        "sum(rate(molt_gateway_prompts_truncated_total{}[RI]))",
                        "first prompts left-truncated/s",
                    ),
                ],
                "",
            ),
            (
                "Rollout pods seen by the gateway",
                "short",
                "timeseries",
                [
                    q("sum by (rollout_url) (molt_gateway_pod_inflight_requests{})", "in flight {{rollout_url}}"),
                    q("min by (rollout_url) (molt_gateway_pod_healthy{})", "healthy {{rollout_url}}"),
                    q(
                        "sum by (rollout_url) (increase(molt_gateway_pod_failovers_total{}[RI]))",
                        "failovers {{rollout_url}}",
                    ),
                ],
                "",
            ),
            (
                "Prefill rescoring (--rollout.rescore_logprobs)",
                "short",
                "timeseries",
                [
                    q("sum(rate(molt_gateway_rescored_segments_total{}[RI]))", "rescored/s"),
                    q("sum by (reason) (rate(molt_gateway_rescore_kept_segments_total{}[RI]))", "kept/s {{reason}}"),
                    *quantiles("molt_gateway_rescore_max_abs_diff_bucket", "", "max |decode - prefill|"),
                ],
                "Segments whose logprobs a prefill pass re-read, those that kept their decode logprobs (by reason), "
                "and the largest decode/prefill gap per segment: the engine noise the flag removes.",
            ),
        ],
    ),
    (
        "Rollout pods",
        [
            (
                "Engine queue",
                "short",
                "timeseries",
                [
                    q("max by (pod) (molt_rollout_running_requests{})", "running {{pod}}"),
                    q("max by (pod) (molt_rollout_waiting_requests{})", "waiting {{pod}}"),
                ],
                "",
            ),
            (
                "KV cache usage",
                "percentunit",
                "timeseries",
                [
                    q("max by (pod) (molt_rollout_kv_cache_usage_ratio{})", "{{pod}}"),
                ],
                "",
            ),
            (
                "Tokens per second",
                "short",
                "timeseries",
                [
                    q("sum by (pod) (rate(molt_rollout_generated_tokens_total{}[RI]))", "generated {{pod}}"),
                    q("sum by (pod) (rate(molt_rollout_prompt_tokens_total{}[RI]))", "prompt {{pod}}"),
                ],
                "",
            ),
            (
                "Requests and aborts",
                "reqps",
                "timeseries",
                [
                    q("sum by (status) (rate(molt_rollout_requests_total{}[RI]))", "{{status}}"),
                    q("sum by (reason) (rate(molt_rollout_request_aborts_total{}[RI]))", "aborted: {{reason}}"),
                ],
                "",
            ),
            (
                "vLLM engine latency (its own metrics)",
                "s",
                "timeseries",
                quantiles("vllm:time_to_first_token_seconds_bucket", "pod", "TTFT {{pod}}", (0.9,))
                + quantiles("vllm:inter_token_latency_seconds_bucket", "pod", "inter-token {{pod}}", (0.9,)),
                "vLLM's engine metrics (vllm:*) that each rollout pod serves next to Molt's on /metrics.",
            ),
            (
                "Builds running",
                "short",
                "timeseries",
                [
                    q("count by (job, version, revision) (molt_build_info{})", "{{job}} {{version}} {{revision}}"),
                ],
                (
                    "Pods per service and build (molt_build_info): two builds of one service mean a rollout in "
                    "progress. Rollout pods also expose vLLM's own engine metrics (vllm:*) on the same /metrics."
                ),
            ),
        ],
    ),
    (
        "Reward and episodes",
        [
            # molt_envs_reward has negative buckets, so prometheus_client exports no _sum: quantiles only.
            (
                "Reward",
                "short",
                "timeseries",
                [
                    q("max(molt_trainer_reward_mean{})", "trainer batch mean"),
                ]
                + quantiles("molt_envs_reward_bucket", "agent", "episodes {{agent}}"),
                "",
            ),
            (
                "Reward distribution",
                "short",
                "heatmap",
                [
                    q("sum by (le) (increase(molt_envs_reward_bucket{}[RI]))", "{{le}}", format="heatmap"),
                ],
                "",
            ),
            (
                "Episodes",
                "ops",
                "timeseries",
                [
                    q("sum by (agent, status) (rate(molt_envs_episodes_total{}[RI]))", "{{agent}} {{status}}"),
                    q("sum(rate(molt_envs_rejected_total{}[RI]))", "rejected (429)"),
                    q("sum(molt_envs_inflight_episodes{})", "in flight"),
                    # agent code blocking a worker's event loop (each past --envs.stall_warn_s): the log has its stack
                    q("sum by (agent) (rate(molt_envs_event_loop_stalls_total{}[RI]))", "event-loop stalls {{agent}}"),
                ],
                "",
            ),
            (
                "Episode time",
                "s",
                "timeseries",
                quantiles("molt_envs_episode_seconds_bucket", "agent", "{{agent}}"),
                "",
            ),
        ],
    ),
    (
        "Trainer",
        [
            (
                "Steps and throughput",
                "short",
                "timeseries",
                [
                    q("max(molt_trainer_step{})", "step"),
                    q("sum(molt_trainer_tokens_per_second{})", "tokens/s"),
                ],
                "",
            ),
            (
                "Loss terms",
                "short",
                "timeseries",
                [
                    q("max by (term) (molt_trainer_loss{})", "{{term}}"),
                ],
                "",
            ),
            (
                "Entropy, clip fraction, grad norm",
                "short",
                "timeseries",
                [
                    q("max(molt_trainer_entropy{})", "entropy"),
                    q("max(molt_trainer_clip_fraction{})", "clip fraction"),
                    q("max(molt_trainer_grad_norm{})", "grad norm"),
                ],
                "",
            ),
            (
                "Step phase time",
                "s",
                "timeseries",
                [
                    mean("molt_trainer_step_seconds", "phase", "{{phase}}"),
                ],
                "",
            ),
        ],
    ),
]


def panel(pid: int, title: str, unit: str, kind: str, targets: list[dict], desc: str, x: int, y: int) -> dict:
    ds = {"type": "prometheus", "uid": "${datasource}"}
    for i, t in enumerate(targets):
        t.setdefault("refId", chr(ord("A") + i))
        t["datasource"] = ds
    p = {
        "id": pid,
        "type": "timeseries",
        "title": title,
        "description": desc,
        "datasource": ds,
        "gridPos": {"h": 8, "w": 8, "x": x, "y": y},
        "targets": targets,
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}},
    }
    if kind == "heatmap":
        p["type"] = "heatmap"
        p["options"] = {"calculate": False, "yAxis": {"unit": unit}, "cellGap": 1}
        for t in targets:
            t["format"] = "heatmap"
    elif kind == "kl":  # KL on the left axis, the policy version (step interpolation) on the right.
        p["fieldConfig"]["overrides"] = [
            {
                "matcher": {"id": "byName", "options": "trainer policy version"},
                "properties": [
                    {"id": "custom.axisPlacement", "value": "right"},
                    {"id": "custom.lineInterpolation", "value": "stepAfter"},
                    {"id": "unit", "value": "none"},
                ],
            }
        ]
    return p


def build() -> dict:
    panels, pid, y = [], 1, 0
    for row, items in ROWS:
        panels.append(
            {
                "id": pid,
                "type": "row",
                "title": row,
                "collapsed": False,
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
                "panels": [],
            }
        )
        pid, y = pid + 1, y + 1
        for i, (title, unit, kind, targets, desc) in enumerate(items):
            panels.append(panel(pid, title, unit, kind, targets, desc, (i % 3) * 8, y + (i // 3) * 8))
            pid += 1
        y += ((len(items) + 2) // 3) * 8
    return {
        "uid": "molt-overview",
        "title": "Molt Services",
        "description": "Queue lag, staleness, mismatch KL, weight sync, gateway latency and reward.",
        "tags": ["molt", "rl"],
        "editable": True,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "30s",
        "time": {"from": "now-3h", "to": "now"},
        "timezone": "",
        "graphTooltip": 1,
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Data source",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {},
                    "hide": 0,
                    "refresh": 1,
                },
                {
                    "name": "namespace",
                    "label": "Namespace",
                    "type": "query",
                    "datasource": {"type": "prometheus", "uid": "${datasource}"},
                    "query": {"query": 'label_values({__name__=~"molt_.+"}, namespace)', "refId": "ns"},
                    "definition": 'label_values({__name__=~"molt_.+"}, namespace)',
                    "includeAll": True,
                    "allValue": ".*",
                    "multi": True,
                    "refresh": 2,
                    "sort": 1,
                    "current": {"text": "All", "value": "$__all"},
                    "hide": 0,
                },
            ]
        },
        "annotations": {"list": []},
        "panels": panels,
    }


def render() -> str:
    return json.dumps(build(), indent=2) + "\n"


if __name__ == "__main__":
    OUT.write_text(render())
    print(f"wrote {OUT}", file=sys.stderr)
