"""The gateway bench's load generator reads whole responses however they are framed and split."""

from __future__ import annotations

import asyncio

import pytest

from bench.gateway import _Connection, header


class _Transport:
    def __init__(self) -> None:
        self.written: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.written.append(data)


CHUNKED = (
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    b'5\r\n{"a":\r\n3;x=y\r\n 1}\r\n0\r\n\r\n'
)
SIZED = b"HTTP/1.1 200 OK\r\nServer-Timing: gateway;dur=0.5, pod;dur=2\r\nContent-Length: 2\r\n\r\nok"


@pytest.mark.parametrize("answer,body", [(SIZED, b"ok"), (CHUNKED, b'{"a": 1}')])
async def test_a_response_split_anywhere_is_read_whole(answer, body):
    for cut in range(1, len(answer)):
        conn = _Connection()
        conn.connection_made(_Transport())
        pending = asyncio.ensure_future(conn.request(b"GET / HTTP/1.1\r\n\r\n"))
        await asyncio.sleep(0)
        conn.data_received(answer[:cut])
        assert not pending.done()
        conn.data_received(answer[cut:] + SIZED[:7])  # the start of a pipelined next answer stays buffered
        head, got = await pending
        assert got == body and head.startswith(b"http/1.1 200") and bytes(conn.buf) == SIZED[:7]
    assert header(SIZED.split(b"\r\n\r\n")[0].lower(), b"server-timing") == b"gateway;dur=0.5, pod;dur=2"


async def test_an_unframed_response_is_an_error():
    conn = _Connection()
    conn.connection_made(_Transport())
    pending = asyncio.ensure_future(conn.request(b"GET / HTTP/1.1\r\n\r\n"))
    await asyncio.sleep(0)
    conn.data_received(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nrest")
    with pytest.raises(RuntimeError, match="no content-length or chunked body"):
        await pending
