"""``bench/gateway_turn.py`` runs end to end on a few sessions (the benchmark itself, not its figures)."""

from __future__ import annotations

import subprocess
import sys

from tests.gateway_testlib import ROOT


def test_gateway_turn_bench_reports_every_row(tiny_qwen3):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.gateway_turn",
            "--model",
            str(tiny_qwen3),
            "--sessions",
            "16",
            "--repeats",
            "1",
            "--burst",
            "8",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {
        line.split("|")[1].strip(): float(line.split("|")[2])
        for line in out.stdout.splitlines()
        if line.startswith("| ") and line.split("|")[1].strip() in ("open", "first", "next", "finish", "burst")
    }
    assert set(rows) == {"open", "first", "next", "finish", "burst"} and all(v > 0 for v in rows.values()), out.stdout
