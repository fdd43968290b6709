"""``Metrics.child``: a labelled series looked up once, counting into the same registry as ``.labels()``."""

from __future__ import annotations

from molt.metrics import Metrics


def test_child_is_the_labelled_series_and_is_kept():
    m = Metrics(["molt_gateway_sessions_total", "molt_gateway_segments_total"])
    written = m.child("molt_gateway_sessions_total", "written")
    assert m.child("molt_gateway_sessions_total", "written") is written
    assert m.child("molt_gateway_sessions_total", "aborted") is not written
    written.inc()
    m["molt_gateway_sessions_total"].labels("written").inc()
    m.child("molt_gateway_segments_total", "first").inc()
    text = m.render()[0].decode()
    assert 'molt_gateway_sessions_total{outcome="written"} 2.0' in text
    assert 'molt_gateway_segments_total{reason="first"} 1.0' in text


def test_loop_local_series_export_what_prometheus_client_does():
    names = [
        "molt_gateway_requests_total",
        "molt_gateway_added_latency_seconds",
        "molt_gateway_trajectories_written_total",
        "molt_gateway_trajectory_bytes_total",
    ]
    plain, local = Metrics(names), Metrics(names, loop_local=tuple(names))
    local["molt_gateway_trajectories_written_total"].inc(3)  # unlabelled: on the series itself; the other at 0
    plain["molt_gateway_trajectories_written_total"].inc(3)
    for m in (plain, local):
        m["molt_gateway_requests_total"].labels("openai", "200").inc()
        m["molt_gateway_requests_total"].labels("openai", "200").inc(2)
        m["molt_gateway_requests_total"].labels("anthropic", "429").inc()
        added = m["molt_gateway_added_latency_seconds"].labels("openai")
        for v in (0.0, 0.0002, 0.00021, 0.003, 0.01, 7.5, 99.0):  # on a bound, just above one, past the last
            added.observe(v)

    def lines(m: Metrics) -> list[str]:
        return sorted(x for x in m.render()[0].decode().splitlines() if "_created" not in x)

    assert lines(local) == lines(plain)
    assert 'molt_gateway_added_latency_seconds_bucket{le="0.0002",wire="openai"} 2.0' in lines(local)


def test_loop_local_series_are_counters_and_histograms_with_their_labels():
    import pytest

    with pytest.raises(ValueError, match="gauge"):
        Metrics(["molt_gateway_open_sessions"], loop_local=("molt_gateway_open_sessions",))
    m = Metrics(["molt_gateway_requests_total"], loop_local=("molt_gateway_requests_total",))
    with pytest.raises(ValueError, match="takes labels"):
        m["molt_gateway_requests_total"].labels("openai")
