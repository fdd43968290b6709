"""``bench/gateway_slow.py`` at CI scale: a reconnect flood of slow clients (ten times the gateway's cap on
connections waiting for their first request head, each reconnecting at once when dropped) and normal requests
still served. The 20,000-connection figure is the benchmark's (BENCHMARKS.md)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.gateway_testlib import ROOT

pytestmark = [pytest.mark.serial, pytest.mark.timeout(240)]


def test_normal_requests_are_served_through_a_reconnect_flood_of_slow_clients():
    cmd = [sys.executable, "-m", "bench.gateway_slow", "--slow", "2000", "--normal", "10", "--window-s", "5"]
    cmd += ["--ramp-s", "5", "--workers", "2", "--gateway-arg=--server.max_pending_connections=200"]
    cmd += ["--gateway-arg=--server.header_timeout_s=2"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=200)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout[out.stdout.index("{") :])
    assert result["gateway_alive"], result
    assert result["slow_dropped"] > result["slow"], result  # the guard dropped them and they came back: a flood
    assert result["served_share"] >= 0.95, result
