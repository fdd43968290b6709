"""The pod starts the gRPC weight-sync receiver (molt.weightsync.server) when --grpc.port is set."""

from __future__ import annotations

import importlib.util

import grpc
import httpx
import pytest
from rollout_testlib import ServerThread, tiny_settings

from molt.net import free_port
from services.rollout.app import build_app

pytestmark = pytest.mark.timeout(300)


@pytest.mark.skipif(importlib.util.find_spec("molt.weightsync.server") is None, reason="weight-sync not built")
def test_grpc_port_starts_the_weightsync_server(tiny_qwen3):
    port = free_port()
    settings = tiny_settings(tiny_qwen3)
    settings.grpc.port = port
    app = build_app(settings)
    with ServerThread(app) as url:
        ready = httpx.get(f"{url}/readyz").json()
        assert ready["ready"] is True and ready["grpc_port"] == port
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            grpc.channel_ready_future(channel).result(timeout=10)
        assert "molt_weightsync_" in httpx.get(f"{url}/metrics").text
