"""Which metric series and labels the shipped dashboard and alert rules query, checked two ways.

``check_catalog`` holds every query against molt/metrics.py CATALOG (names, kinds, labels);
``check_scrape`` holds them against what running services actually export on /metrics. The PromQL
"parser" is deliberately small: it finds ``molt_*`` selectors with their matchers, the labels of
``by/without/on/ignoring/group_*`` clauses, and labels named in legends (``{{pod}}``) and alert
annotations (``$labels.pod``). That is all the queries here use; tests keep it that way.

Run ``python deploy/metric_refs.py`` for the list of queried series (dashboard only).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

DASHBOARD = Path(__file__).resolve().parent / "k8s" / "molt" / "dashboards" / "molt-overview.json"

SELECTOR_RE = re.compile(r"\b(molt_[a-z0-9_]+)\b(\s*\{([^}]*)\})?")
GROUPING_RE = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
MATCHER_RE = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*\"")
LEGEND_RE = re.compile(r"\{\{\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\}\}")
ANNOTATION_LABEL_RE = re.compile(r"\$labels\.([a-zA-Z_][a-zA-Z0-9_]*)")
# Labels Prometheus attaches to every scraped series (Kubernetes service discovery, or static
# labels in deploy/compose/prometheus.yml): queries may group by them on any metric.
TARGET_LABELS = frozenset({"namespace", "pod", "job", "instance", "service", "container", "endpoint"})
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


@dataclass
class Query:
    source: str
    expr: str
    labels_out: set[str] = field(default_factory=set)  # labels a legend/annotation reads from the result


@dataclass
class Selector:
    series: str
    matchers: set[str]


def dashboard_queries(dashboard: dict) -> list[Query]:
    out = []

    def walk(panels):
        for p in panels:
            walk(p.get("panels", []))
            for t in p.get("targets", []):
                legend = t.get("legendFormat", "")
                out.append(
                    Query(
                        f"panel {p.get('title')!r} {t.get('refId')}",
                        t["expr"],
                        set(LEGEND_RE.findall(legend)) - {"le"},
                    )
                )

    walk(dashboard.get("panels", []))
    for var in dashboard.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            out.append(Query(f"variable {var['name']}", query))
    return out


def rule_queries(prometheus_rule: dict) -> list[Query]:
    out = []
    for group in prometheus_rule["spec"]["groups"]:
        for rule in group["rules"]:
            name = rule.get("alert") or rule.get("record")
            text = " ".join(str(v) for v in rule.get("annotations", {}).values())
            out.append(Query(f"rule {name}", rule["expr"], set(ANNOTATION_LABEL_RE.findall(text))))
    return out


def selectors(expr: str) -> list[Selector]:
    return [
        Selector(m.group(1), {name for name, _ in MATCHER_RE.findall(m.group(3) or "")})
        for m in SELECTOR_RE.finditer(expr)
    ]


def grouping_labels(expr: str) -> set[str]:
    labels = set()
    for _, inner in GROUPING_RE.findall(expr):
        labels |= {x.strip() for x in inner.split(",") if x.strip()}
    return labels


def resolve(series: str, catalog: dict) -> tuple[object | None, str]:
    """(catalog spec, suffix) of a queried series; spec None when the catalog has no such series."""
    spec = catalog.get(series)
    if spec is not None:
        return (spec, "") if spec.kind != "histogram" else (None, "")
    for suffix in HISTOGRAM_SUFFIXES:
        base = series[: -len(suffix)]
        if series.endswith(suffix) and getattr(catalog.get(base), "kind", None) == "histogram":
            return catalog[base], suffix
    return None, ""


def _labels_of(spec, suffix: str) -> set[str]:
    return set(spec.labels) | ({"le"} if suffix == "_bucket" else set())


def check_catalog(queries: list[Query], catalog: dict) -> list[str]:
    """Errors: unknown series, a counter without _total, labels the catalog does not give the metric."""
    errors = []
    for q in queries:
        sels = selectors(q.expr)
        offered: set[str] = set(TARGET_LABELS)
        for sel in sels:
            spec, suffix = resolve(sel.series, catalog)
            if spec is None:
                hint = ""
                if sel.series in catalog:
                    hint = " (a histogram: query its _bucket, _sum or _count series)"
                elif sel.series + "_total" in catalog:
                    hint = f" (counters are exposed as {sel.series}_total)"
                errors.append(f"{q.source}: {sel.series} is not in molt/metrics.py CATALOG{hint}")
                continue
            if spec.kind == "counter" and not sel.series.endswith("_total"):
                errors.append(f"{q.source}: counter {sel.series} must be queried as ..._total")
            if suffix == "_sum" and spec.buckets and spec.buckets[0] < 0:
                errors.append(
                    f"{q.source}: {sel.series} never exists: prometheus_client omits _sum for a "
                    "histogram with negative buckets; use histogram_quantile over _bucket"
                )
            own = _labels_of(spec, suffix)
            offered |= own
            for label in sel.matchers - own - TARGET_LABELS - {"__name__"}:
                errors.append(f"{q.source}: {sel.series} has no label {label!r} (catalog: {sorted(own)})")
        if sels:
            for label in (grouping_labels(q.expr) | q.labels_out) - offered:
                errors.append(f"{q.source}: label {label!r} is on none of {[s.series for s in sels]}")
    return errors


def required_labels(queries: list[Query], catalog: dict) -> dict[str, set[str]]:
    """Per queried series, the catalog labels the queries rely on (what a scrape must show)."""
    need: dict[str, set[str]] = {}
    for q in queries:
        wanted = grouping_labels(q.expr) | q.labels_out
        for sel in selectors(q.expr):
            spec, suffix = resolve(sel.series, catalog)
            own = _labels_of(spec, suffix) if spec else set()
            need.setdefault(sel.series, set()).update((wanted | sel.matchers) & own)
    return need


def scraped_series(text: str) -> tuple[set[str], dict[str, list[set[str]]]]:
    """(declared series names, series name -> label-name sets of its samples) of one /metrics body."""
    from prometheus_client.parser import text_string_to_metric_families

    declared, samples = set(), {}
    for fam in text_string_to_metric_families(text):
        if fam.samples:  # what is really there (a histogram with negative buckets has no _sum)
            declared.update(s.name for s in fam.samples if not s.name.endswith("_created"))
        elif fam.type == "counter":
            declared.add(fam.name + "_total")
        elif fam.type == "histogram":
            declared.update(fam.name + s for s in HISTOGRAM_SUFFIXES)
        else:
            declared.add(fam.name)
        for s in fam.samples:
            samples.setdefault(s.name, []).append(set(s.labels))
    return declared, samples


def check_scrape(
    need: dict[str, set[str]], declared: set[str], samples: dict[str, list[set[str]]]
) -> tuple[list[str], list[str]]:
    """(errors, unobserved): a queried series nobody exports, or exported without a queried label;
    unobserved lists labelled series that exist but have no sample yet (labels not visible)."""
    errors, unobserved = [], []
    for series, labels in sorted(need.items()):
        if series not in declared:
            errors.append(f"{series}: not exported by any running service")
            continue
        if not labels:
            continue
        seen = samples.get(series, [])
        if not seen:
            unobserved.append(series)
            continue
        for label in sorted(labels):
            if not all(label in s for s in seen):
                errors.append(f"{series}: samples lack label {label!r} (got {sorted(set().union(*seen))})")
    return errors, unobserved


if __name__ == "__main__":
    for q in dashboard_queries(json.loads(DASHBOARD.read_text())):
        print(f"{q.source}: {sorted({s.series for s in selectors(q.expr)})}")
