"""The one service skeleton (molt/serve.py) on a real process: the two lines, /readyz, SIGTERM -> exit 0, and
``start_service`` failing fast on a service that exits."""

from __future__ import annotations

import signal
import sys

import httpx
import pytest

from molt.serve import start_service
from tests.gateway_testlib import ROOT, stop

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


def test_a_service_on_every_ipv6_address_names_a_url_that_parses_and_serves_both_families(tmp_path):
    """``--server.host ::`` (the chart's ``listenAddress`` on an IPv6 cluster): the skeleton's lines bracket the
    address, so the URL ``start_service`` reads from them parses, and the one socket takes both families."""
    serve = "from molt.config import ServerConfig; from molt.serve import serve; import tests.gateway_testlib as t; "
    serve += "serve('instant-pod', t._instant_pod, ServerConfig(host='::', log_level='warning'))"
    proc, url = start_service([sys.executable, "-c", serve], log_path=tmp_path / "pod.log", cwd=ROOT)
    try:
        port = httpx.URL(url).port
        assert url == f"http://[::]:{port}"
        for host in ("[::1]", "127.0.0.1"):
            assert httpx.get(f"http://{host}:{port}/readyz").status_code == 200
    finally:
        stop(proc)


def test_start_service_fails_fast_when_the_service_exits(tmp_path):
    with pytest.raises(RuntimeError, match="exited with 3"):
        start_service([sys.executable, "-c", "raise SystemExit(3)"], log_path=tmp_path / "x.log")


def test_a_sigterm_the_moment_a_service_listens_is_a_clean_stop():
    """A supervisor may signal a service at any point of its start (Kubernetes scaling down a pod still starting):
    the service's own handling holds from the moment it serves, so the stop is graceful and the exit status 0,
    never the signal's (uvicorn's own handler re-raises the signal after a shutdown it handled)."""
    import subprocess

    from molt.serve import cpu_env

    for _ in range(3):
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.gateway_testlib", "instant-pod"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=ROOT,
            env=cpu_env(),
        )
        assert proc.stdout is not None
        for line in proc.stdout:
            if " listening on " in line:
                break
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=30)[0]
        assert proc.returncode == 0, out


SLOW_APP = """
import asyncio
from molt.config import ServerConfig
from molt.serve import serve
import tests.gateway_testlib as t

async def app(scope, receive, send):
    if scope["type"] == "http" and scope["path"] == "/slow":  # a turn still running when the signal comes
        await asyncio.sleep(60)
    await t._instant_pod(scope, receive, send)

serve("draining", app, ServerConfig(log_level="warning"), drain=lambda: asyncio.sleep(60))
"""


@pytest.mark.parametrize("second", [signal.SIGTERM, signal.SIGINT])
def test_a_second_signal_during_a_drain_stops_at_once(tmp_path, second):
    """SIGTERM starts the drain (here one that would last a minute, as open sessions can, with a request in
    flight); a second SIGTERM, or a Ctrl-C, ends the process at once with status 0 instead of waiting for them."""
    import threading
    import time

    proc, url = start_service([sys.executable, "-c", SLOW_APP], log_path=tmp_path / "d.log", cwd=ROOT)
    slow = threading.Thread(target=lambda: httpx.get(f"{url}/slow", timeout=90), daemon=True)
    try:
        slow.start()
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        time.sleep(1.0)
        assert proc.poll() is None  # draining
        sent = time.monotonic()
        proc.send_signal(second)
        assert proc.wait(30) == 0
        assert time.monotonic() - sent < 5
    finally:
        stop(proc)
