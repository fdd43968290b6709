"""Slow clients do not starve a real gateway process (molt/serve_guard.py, the edge's body timeout).

The full-size run (20,000 slow connections) is ``python -m bench.gateway_slow``; here the same driver runs
scaled down against a gateway limited to 512 open files, so that without the guard the slow connections
would take every descriptor (the bench's unguarded run serves none)."""

from __future__ import annotations

import asyncio
import sys

import pytest

from bench.gateway_slow import run
from tests.gateway_testlib import start_gateway, start_instant_pod, stop

pytestmark = pytest.mark.timeout(120)

FD_LIMIT = [
    sys.executable,
    "-c",
    "import os, resource, sys; resource.setrlimit(resource.RLIMIT_NOFILE, (512, 512)); "
    "os.execvp(sys.argv[1], sys.argv[1:])",
]


def test_normal_requests_are_served_among_many_slow_connections(tiny_qwen3, tmp_path):
    result = run(
        str(tiny_qwen3),
        600,
        20,
        window_s=5,
        ramp_s=4,
        workers=2,
        request_timeout_s=10,
        prefix=FD_LIMIT,
        log_dir=tmp_path,
        gateway_args=["--server.max_pending_connections", "300", "--server.header_timeout_s", "2"],
    )
    assert result["gateway_alive"]
    assert result["served"] >= 19, result  # >= 95%
    assert result["slow_dropped"] > 0  # the guard closed slow connections (they reconnect, as attackers do)


@pytest.fixture
def gateway(tiny_qwen3, tmp_path):
    pod, pod_url = start_instant_pod(tmp_path / "pod.log")
    try:
        proc, url = start_gateway(
            [
                "--model.path",
                str(tiny_qwen3),
                "--rollout.urls",
                pod_url,
                "--redis.url",
                "memory://",
                "--server.header_timeout_s",
                "1",
                "--server.body_timeout_s",
                "1",
            ],
            tmp_path / "gateway.log",
        )
    except BaseException:
        stop(pod)
        raise
    yield url.rsplit(":", 1)[-1]
    stop(proc)
    stop(pod)


async def _exchange(port: str, data: bytes) -> bytes:
    """Send ``data`` and read until the gateway closes the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", int(port))
    writer.write(data)
    try:
        return await asyncio.wait_for(reader.read(), 30)
    finally:
        writer.close()


async def test_a_head_that_never_ends_is_closed_and_a_body_that_stalls_gets_a_408(gateway):
    assert await _exchange(gateway, b"") == b""  # nothing sent: closed, nothing answered
    assert await _exchange(gateway, b"POST /v1/sessions HTTP/1.1\r\nHost: x\r\n") == b""  # half a head
    answer = await _exchange(
        gateway,
        b"POST /v1/sessions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b'Content-Length: 100\r\n\r\n{"a": ',
    )
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408") and b"connection: close" in head.lower()
    assert b'"code":"request_timeout"' in body
    # A normal request right after is served as usual.
    answer = await _exchange(
        gateway,
        b"POST /v1/sessions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 2\r\nConnection: close\r\n\r\n{}",
    )
    assert answer.startswith(b"HTTP/1.1 201")
