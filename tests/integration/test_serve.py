"""The one service skeleton (molt/serve.py) on a real process: the two lines, /readyz, SIGTERM -> exit 0, and
``start_service`` failing fast on a service that exits."""

from __future__ import annotations

import signal
import sys

import httpx
import pytest

from molt.serve import start_service
from tests.gateway_testlib import ROOT

pytestmark = pytest.mark.timeout(60)


def test_a_service_announces_itself_answers_readyz_and_exits_0_on_sigterm(tmp_path):
    log = tmp_path / "pod.log"
    proc, url = start_service([sys.executable, "-m", "tests.gateway_testlib", "instant-pod"], log_path=log, cwd=ROOT)
    try:
        assert httpx.get(f"{url}/readyz").status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(30)
    lines = log.read_text().splitlines()
    assert f"molt-instant-pod listening on {url}" in lines and f"molt-instant-pod ready {url}" in lines
    assert code == 0


def test_start_service_fails_fast_when_the_service_exits(tmp_path):
    with pytest.raises(RuntimeError, match="exited with 3"):
        start_service([sys.executable, "-c", "raise SystemExit(3)"], log_path=tmp_path / "x.log")
