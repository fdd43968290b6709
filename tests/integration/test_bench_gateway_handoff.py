"""``bench/gateway_handoff.py`` runs end to end on a few sessions in real Redis and leaves no key behind (the
benchmark itself, not its figures)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import redis

from tests.gateway_testlib import ROOT

pytestmark = pytest.mark.redis


def test_gateway_handoff_bench_reports_every_phase(redis_url):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.gateway_handoff",
            "--redis-url",
            redis_url,
            "--sessions",
            "20",
            "--tokens",
            "256",
            "--repeats",
            "1",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {
        line.split("|")[1].strip(): float(line.split("|")[3])
        for line in out.stdout.splitlines()
        if line.startswith("| ") and line.split("|")[1].strip() in ("park", "adopt", "plain write", "plain read")
    }
    assert set(rows) == {"park", "adopt", "plain write", "plain read"} and all(v > 0 for v in rows.values())
    r = redis.Redis.from_url(redis_url)
    try:
        assert not list(r.scan_iter(match="molt:bench:handoff:*"))
    finally:
        r.close()
