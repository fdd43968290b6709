"""Slow clients do not hold a real gateway's connections (molt/serve_guard.py, the edge's body timeout).

How many normal requests get through a flood of slow connections is measured by ``python -m bench.gateway_slow``
(20,000 connections); ``test_bench_gateway_slow.py`` runs it at CI scale."""

from __future__ import annotations

import asyncio

import pytest

from tests.gateway_testlib import start_gateway, start_instant_pod, stop

pytestmark = [pytest.mark.serial, pytest.mark.timeout(120)]
MAX_PENDING = 20


@pytest.fixture
def gateway(tiny_qwen3, tmp_path):
    pod, pod_url = start_instant_pod(tmp_path / "pod.log")
    cap = str(MAX_PENDING)
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
                "--server.max_pending_connections",
                cap,
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


async def test_past_the_cap_the_longest_waiting_connections_are_closed_and_a_normal_request_is_served(gateway):
    port = int(gateway)
    held = []
    for _ in range(2 * MAX_PENDING):  # half a head each, then nothing
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/sessions HTTP/1.1\r\nHost: x\r\n")
        await writer.drain()
        held.append((reader, writer))
        await asyncio.sleep(0.005)
    await asyncio.sleep(0.1)  # all of this well inside --server.header_timeout_s (1 s)
    oldest_closed = await asyncio.wait_for(asyncio.gather(*(r.read() for r, _ in held[:MAX_PENDING])), 0.3)
    newest_open = [not r.at_eof() for r, _ in held[MAX_PENDING:]]
    answer = await _exchange(
        gateway,
        b"POST /v1/sessions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 2\r\nConnection: close\r\n\r\n{}",
    )
    for _, w in held:
        w.close()
    assert oldest_closed == [b""] * MAX_PENDING  # closed, unanswered, to make room
    assert all(newest_open)
    assert answer.startswith(b"HTTP/1.1 201")
