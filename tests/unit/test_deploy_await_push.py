"""Rollout pods that await the trainer's push (``--weights.await_push``): the chart (``rollout.awaitPush``, on by
default) and compose run them that way, and nothing that must run before the trainer's first push waits for a
pod to be Ready. A pod answers HTTP only once its model is loaded, then /readyz 503 with its ``grpc_port`` until
a push: the trainer's init container and compose's rollout healthcheck must accept that answer. Their Python
snippets run here, as rendered, against a tiny HTTP server on 127.0.0.1."""

from __future__ import annotations

import http.server
import json
import select
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

from deploy import tools
from tests.unit.test_deploy_compose import ENV
from tests.unit.test_deploy_helm import by_kind, container

FLAG = "--weights.await_push=true"
AWAITING = {"ready": False, "policy_version": 0, "grpc_port": 1234, "vocab": ""}


class _Pod(http.server.BaseHTTPRequestHandler):
    """/readyz as a rollout pod answers it: ``server.answer`` is (status, body)."""

    def do_GET(self) -> None:
        status, body = self.server.answer if self.path == "/readyz" else (404, b"{}")
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def pod() -> Iterator[http.server.ThreadingHTTPServer]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Pod)
    server.answer = (503, json.dumps(AWAITING).encode())
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def _url(server: http.server.ThreadingHTTPServer) -> str:
    return f"http://127.0.0.1:{server.server_address[1]}"


@pytest.fixture
def refused() -> Iterator[str]:
    """A URL whose port is bound but not listening: a connection is refused (a pod not started yet)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    sock.close()


@pytest.fixture(scope="module")
def chart() -> dict[str, list[dict]]:
    return {
        "default": tools.render(),
        "off": tools.render(sets=("rollout.awaitPush=false",)),
        "no-trainer": tools.render(sets=("trainer.enabled=false",)),
    }


@pytest.fixture(scope="module")
def compose() -> dict:
    return tools.load_compose(ENV)


def _still_waiting(argv: list[str]) -> str:
    """Run a wait loop that must not finish: return its first progress line once it printed one."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 10)
        assert ready, "the wait printed nothing"
        line = proc.stdout.readline()
        assert proc.poll() is None, f"the wait ended (exit {proc.returncode}): {line}{proc.stdout.read()}"
        return line
    finally:
        proc.kill()
        proc.wait()


def _init_container(docs: list[dict]) -> dict:
    sts = by_kind(docs, "StatefulSet")["molt-trainer"]
    (init,) = sts["spec"]["template"]["spec"]["initContainers"]
    assert init["name"] == "wait-for-rollout"
    return init


def test_rollout_pods_await_the_push_by_default_and_serve_at_once_when_told(chart):
    rollout = container(chart["default"], "molt-rollout")
    assert rollout["args"].count(FLAG) == 1
    # Serving without a trainer: awaitPush=false, and no trainer in the release to push at all.
    for name in ("off", "no-trainer"):
        args = container(chart[name], "molt-rollout")["args"]
        assert not any(a.startswith("--weights.await_push") for a in args), name


def test_the_install_notes_say_how_pods_get_their_weights():
    """Without the chart's trainer, awaitPush is off whatever its value: the notes say so, and how a trainer run
    elsewhere gets it back (rollout.extraArgs), instead of leaving it silent."""
    from tests.unit.test_deploy_chart_security import _notes

    assert "turn Ready only once the trainer has pushed" in _notes()
    for sets in (("trainer.enabled=false",), ("trainer.enabled=false", "rollout.awaitPush=true")):
        assert "add --weights.await_push=true to rollout.extraArgs" in _notes(*sets)
    assert "pushed" not in _notes("rollout.awaitPush=false") and "extraArgs" not in _notes("rollout.awaitPush=false")


def test_nothing_in_the_chart_waits_for_a_ready_rollout_pod(chart):
    docs = chart["default"]
    sts = by_kind(docs, "StatefulSet")["molt-rollout"]
    # The trainer must reach pods that are not Ready (its push is what makes them Ready).
    assert by_kind(docs, "Service")[sts["spec"]["serviceName"]]["spec"]["publishNotReadyAddresses"] is True
    c = sts["spec"]["template"]["spec"]["containers"][0]
    # /readyz stays 503 until the push: a startup or liveness probe on it would restart pods forever.
    assert c["startupProbe"]["httpGet"]["path"] == "/healthz"
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    init = _init_container(docs)
    urls = init["args"]
    assert urls and all(u.startswith("http://molt-rollout-") for u in urls)
    assert "/readyz" in init["command"][-1] and "grpc_port" in init["command"][-1]


@pytest.mark.parametrize("status", [503, 200])
def test_trainer_init_container_accepts_a_loaded_pod_whether_or_not_pushed(chart, pod, status):
    pod.answer = (status, json.dumps({**AWAITING, "ready": status == 200}).encode())
    init = _init_container(chart["default"])
    out = subprocess.run([sys.executable, *init["command"][1:], _url(pod)], capture_output=True, text=True, timeout=20)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "waiting" not in out.stdout


def test_trainer_init_container_waits_for_every_pod_to_answer_with_its_port(chart, pod, refused):
    init = _init_container(chart["default"])
    # The first pod is loaded; the second refuses connections (not started): the wait goes on for it.
    line = _still_waiting([sys.executable, *init["command"][1:], _url(pod), refused])
    assert line.startswith(f"waiting for {refused}/readyz"), line
    # An answer without grpc_port (a proxy's error page, a pod without weight sync) is not enough.
    pod.answer = (503, b'{"error": "upstream connect error"}')
    line = _still_waiting([sys.executable, *init["command"][1:], _url(pod)])
    assert line.startswith(f"waiting for {_url(pod)}/readyz: no grpc_port"), line


def test_compose_rollout_runs_awaiting_the_push(compose):
    assert compose["services"]["rollout"]["command"].count(FLAG) == 1


def _compose_healthcheck(compose: dict, url: str) -> subprocess.CompletedProcess:
    test = compose["services"]["rollout"]["healthcheck"]["test"]
    assert test[:3] == ["CMD", "python", "-c"], test
    code = test[3]
    assert "http://127.0.0.1:8000/readyz" in code
    return subprocess.run(
        [sys.executable, "-c", code.replace("http://127.0.0.1:8000", url)], capture_output=True, text=True, timeout=20
    )


@pytest.mark.parametrize("status", [503, 200])
def test_compose_rollout_is_healthy_once_loaded_whether_or_not_pushed(compose, pod, status):
    pod.answer = (status, json.dumps({**AWAITING, "ready": status == 200}).encode())
    out = _compose_healthcheck(compose, _url(pod))
    assert out.returncode == 0, out.stderr


def test_compose_rollout_is_unhealthy_before_it_answers_with_its_port(compose, pod, refused):
    assert _compose_healthcheck(compose, refused).returncode != 0
    pod.answer = (503, b'{"error": "upstream connect error"}')
    assert _compose_healthcheck(compose, _url(pod)).returncode != 0
