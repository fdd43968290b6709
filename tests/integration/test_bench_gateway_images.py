"""``bench/gateway_images.py`` runs end to end on a few image turns (the benchmark itself, not its figures)."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]


def test_gateway_images_bench_reports_both_sides(tiny_idefics3, tmp_path):
    from bench import gateway_images

    rows = gateway_images.main(
        ["--model", str(tiny_idefics3), "--requests", "4", "--rounds", "1", "--concurrency", "1", "2"]
    )
    assert [r["concurrency"] for r in rows] == [1, 2]
    for r in rows:
        assert r["requests"] >= 4 and r["direct_rps"] > 0 and r["gateway_rps"] > 0
        assert r["ratio"] == pytest.approx(r["gateway_rps"] / r["direct_rps"], rel=0.02)
        assert 0 <= r["added_p50_ms"] <= r["added_p99_ms"]
