"""The Grafana dashboard and the PrometheusRule alerts query only what molt/metrics.py CATALOG
defines (names, kinds, labels), the dashboard JSON is what deploy/grafana/dashboard.py builds, and
the queries are well formed. tests/integration/test_deploy_metrics.py checks the same queries
against what running services export."""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import pytest

from molt.metrics import CATALOG

ROOT = Path(__file__).resolve().parents[2]


from deploy import metric_refs as refs  # noqa: E402
from deploy import tools  # noqa: E402
from deploy.grafana import dashboard as builder  # noqa: E402

ALERTS = {  # every alert we promise, by name
    "MoltQueueBacklogGrowing",
    "MoltQueueOldestUnackedOld",
    "MoltMismatchKLFreshHigh",
    "MoltWeightSyncFailing",
    "MoltWeightSyncSlow",
    "MoltWeightApplySlow",
    "MoltRolloutPolicyBehind",
    "MoltNoTrajectoriesArriving",
    "MoltPodsNotReady",
    "MoltTargetDown",
    "MoltRolloutPodUnhealthy",
}
# Non-Molt series the rules may read: Prometheus' own and kube-state-metrics'.
FOREIGN_SERIES = {"up", "kube_pod_status_ready"}
PROMQL_WORDS = {
    "sum",
    "max",
    "min",
    "count",
    "avg",
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "and",
    "or",
    "unless",
    "rate",
    "increase",
    "deriv",
    "delta",
    "histogram_quantile",
    "clamp_min",
    "scalar",
    "absent",
    "label_values",
    "namespace",
    "le",
    "stream",
    "pod",
    "rollout_url",
    "side",
    "phase",
    "wire",
    "code",
    "agent",
    "status",
    "reason",
    "outcome",
    "transport",
    "term",
    "condition",
    "job",
    "__name__",
    "humanize",
    "bool",
    "abs",
}


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(refs.DASHBOARD.read_text())


@pytest.fixture(scope="module")
def rule() -> dict:
    # The multi-node value set turns on every rule (incl. the autoscaling record and kube-state-metrics).
    docs = tools.render("ci/multinode-trainer-values.yaml")
    return next(d for d in docs if d["kind"] == "PrometheusRule")


def test_dashboard_json_is_generated_from_the_builder(dashboard):
    assert json.loads(builder.render()) == dashboard, "run: python deploy/grafana/dashboard.py"


def test_every_queried_name_and_label_is_in_the_catalog(dashboard, rule):
    queries = refs.dashboard_queries(dashboard) + refs.rule_queries(rule)
    assert len(queries) > 60
    errors = refs.check_catalog(queries, CATALOG)
    assert not errors, "\n".join(errors)


def test_dashboard_covers_the_issue_topics(dashboard):
    series = {s.series for q in refs.dashboard_queries(dashboard) for s in refs.selectors(q.expr)}
    for must in (
        "molt_queue_undelivered_entries",
        "molt_queue_oldest_unacked_age_seconds",  # queue lag
        "molt_trainer_staleness_versions_bucket",  # staleness
        "molt_trainer_mismatch_kl",
        "molt_trainer_policy_version",  # mismatch KL per pod and version
        "molt_weightsync_phase_seconds_bucket",
        "molt_rollout_weight_apply_seconds_bucket",  # sync phases
        "molt_gateway_added_latency_seconds_bucket",  # gateway latency
        "molt_trainer_reward_mean",
        "molt_envs_reward_bucket",
    ):  # reward
        assert must in series, must
    unused = {n for n in CATALOG if not any(s == n or s.rsplit("_", 1)[0] == n for s in series)}
    if unused:  # a new catalog metric is no error, but it likely wants a panel
        warnings.warn(f"catalog metrics with no dashboard panel: {sorted(unused)}", stacklevel=1)


def test_alert_set_and_rule_shape(rule):
    alerts = {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r}
    assert ALERTS <= set(alerts)
    for name, r in alerts.items():
        assert r["labels"]["severity"] in {"info", "warning", "critical"}, name
        assert r["annotations"]["summary"] and r["annotations"]["description"], name
        for sel in refs.selectors(r["expr"]):  # every Molt selector is scoped to the release namespace
            assert re.search(sel.series + r'\{namespace="rl"', r["expr"]), (name, sel.series)


def _strip_strings(expr: str) -> str:
    return re.sub(r'"(\\.|[^"\\])*"', '""', expr)


def test_queries_are_well_formed(dashboard, rule):
    for q in refs.dashboard_queries(dashboard) + refs.rule_queries(rule):
        bare = _strip_strings(q.expr)
        stack = []
        for ch in bare:
            if ch in "([{":
                stack.append(ch)
            elif ch in ")]}":
                assert stack and "([{"[")]}".index(ch)] == stack.pop(), q
        assert not stack, q
        assert "[RI]" not in q.expr and "{}" not in bare, q
        if q.source.startswith("rule"):
            words = set(re.findall(r"[a-zA-Z_][a-zA-Z0-9_:]*", re.sub(r"\[[^\]]*\]", "", bare)))
            foreign = {w for w in words if not w.startswith(("molt_", "molt:"))} - PROMQL_WORDS - FOREIGN_SERIES
            assert not foreign, (q.source, foreign)


def test_panel_layout(dashboard):
    panels = dashboard["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    cells = set()
    for p in panels:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"panel {p['title']!r} overlaps another"
                cells.add((x, y))
        for t in p.get("targets", []):
            assert t["refId"] and t["datasource"]["uid"] == "${datasource}"
    names = [v["name"] for v in dashboard["templating"]["list"]]
    assert names == ["datasource", "namespace"]


@pytest.mark.parametrize(
    "expr, fragment",
    [
        ("molt_gateway_requests{}", "counters are exposed as molt_gateway_requests_total"),
        ("molt_gateway_added_latency_seconds", "a histogram"),
        ("sum by (pod) (rate(molt_envs_rejected_total[5m]))", None),  # pod: a target label, allowed
        ("sum by (wire) (rate(molt_envs_rejected_total[5m]))", "label 'wire'"),
        ('molt_weightsync_failures_total{phase="x"}', "no label 'phase'"),
        ("molt_queue_lag_entries", "not in molt/metrics.py CATALOG"),
        ("histogram_quantile(0.9, sum by (le) (rate(molt_trainer_step_seconds_bucket[5m])))", None),
        # Reward buckets are non-negative, so the histogram keeps its _sum (mean reward on the dashboard).
        ("rate(molt_envs_reward_sum[5m])", None),
    ],
)
def test_catalog_check_catches_mistakes(expr, fragment):
    errors = refs.check_catalog([refs.Query("test", expr)], CATALOG)
    if fragment is None:
        assert not errors
    else:
        assert any(fragment in e for e in errors), errors


def test_scrape_check_reports_missing_names_and_labels():
    text = (
        "# HELP molt_gateway_requests_total Requests.\n# TYPE molt_gateway_requests_total counter\n"
        'molt_gateway_requests_total{wire="openai"} 1.0\n'
        "# HELP molt_gateway_open_sessions Open.\n# TYPE molt_gateway_open_sessions gauge\n"
        "molt_gateway_open_sessions 0.0\n"
        "# HELP molt_envs_rejected_total Rejected.\n# TYPE molt_envs_rejected_total counter\n"
        "# HELP molt_gateway_errors_total Errors.\n# TYPE molt_gateway_errors_total counter\n"
    )
    declared, samples = refs.scraped_series(text)
    queries = [
        refs.Query("a", "sum by (wire, code) (rate(molt_gateway_requests_total[5m]))"),
        refs.Query("b", "sum(molt_gateway_open_sessions)"),
        refs.Query("c", "sum by (code) (rate(molt_gateway_errors_total[5m]))"),
        refs.Query("d", "max(molt_trainer_step)"),
    ]
    errors, unobserved = refs.check_scrape(refs.required_labels(queries, CATALOG), declared, samples)
    assert any("molt_gateway_requests_total: samples lack label 'code'" in e for e in errors)
    assert any("molt_trainer_step: not exported" in e for e in errors)
    assert unobserved == ["molt_gateway_errors_total"]


def test_no_series_label_is_a_target_label():
    """Prometheus and Kubernetes set pod/namespace/job/instance/... on every scraped series: a Molt label of
    the same name would clobber them (or be renamed exported_pod). The rollout pod a series is about is
    `rollout_url`."""
    from molt.metrics import CATALOG

    for spec in CATALOG.values():
        assert not set(spec.labels) & refs.TARGET_LABELS, (spec.name, spec.labels)
