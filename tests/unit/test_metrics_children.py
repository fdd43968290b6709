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
