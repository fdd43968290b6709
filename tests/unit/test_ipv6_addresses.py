"""IPv6 literals wherever a host and a port are joined (the chart's ``listenAddress="::"``, a pod URL on an IPv6
address): the weight-sync gRPC server binds ``::``, the trainer's pod discovery gives a dialable target, and the
skeleton's lines name a URL that parses."""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from test_rollout_routes import FakeEngine

from molt.net import host_port
from molt.weightsync.client import GrpcPodClient
from molt.weightsync.server import start_weightsync_server
from services.trainer.publish import discover_targets


def test_host_port_brackets_ipv6_literals_only():
    assert host_port("::", 50051) == "[::]:50051"
    assert host_port("fd00::1", 8000) == "[fd00::1]:8000"
    assert host_port("[::1]", 1) == "[::1]:1"
    assert host_port("10.0.0.1", 2) == "10.0.0.1:2" and host_port("pod-0.rollout", 3) == "pod-0.rollout:3"


async def test_the_weight_sync_server_on_every_address_answers_both_families():
    server, port = await start_weightsync_server(FakeEngine(), "::", 0, token="t0k")
    try:
        for host in ("::1", "127.0.0.1"):
            status = await GrpcPodClient(host_port(host, port), token="t0k").status()
            assert status.version == FakeEngine().policy_version
    finally:
        await server.stop(0)


class _V6Server(ThreadingHTTPServer):
    address_family = socket.AF_INET6


class _Readyz(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = json.dumps({"ready": True, "grpc_port": 50051}).encode()
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


def test_a_pod_url_on_an_ipv6_address_gives_a_bracketed_grpc_target():
    server = _V6Server(("::1", 0), _Readyz)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://{host_port('::1', server.server_address[1])}"
        assert discover_targets([url], wait_s=5) == ["[::1]:50051"]
    finally:
        server.shutdown()
        server.server_close()
