"""The gateway's generate stream (PodChannel) and the pool's use of it, against raw loopback pods that
misbehave in every way a stream can: no endpoint, dropped connection, garbage, silence, early end."""

from __future__ import annotations

import asyncio
import json

import pytest

from services.gateway.channel import PodChannel
from services.gateway.metrics import gateway_metrics
from services.gateway.pods import PodFailed, PodPool
from services.gateway.transport import HttpTransport, PodConnectionError, generate_body

pytestmark = pytest.mark.timeout(60)


def answer_for(call: dict) -> dict:
    n = call["sampling_params"].get("max_tokens", 1)
    return {
        "id": call["id"],
        "status": 200,
        "policy_version": 1,
        "outputs": [{"token_ids": [5] * n, "logprobs": [-0.5] * n, "finish_reason": "length"}],
    }


class StreamPod:
    """A raw pod: ``mode`` "stream" answers calls (``reply(call)`` -> (delay_s, line bytes | None) or "drop"),
    "404" has no stream endpoint but answers /v1/generate, "end" ends the response after the first call."""

    def __init__(self, mode: str = "stream", reply=None) -> None:
        self.mode, self.reply = mode, reply or (lambda call: (0.0, json.dumps(answer_for(call)).encode()))
        self.lines: list[dict] = []
        self.streams = 0
        self.singles = 0

    async def __aenter__(self) -> StreamPod:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                if head.startswith(b"POST /v1/generate_stream"):
                    if self.mode == "404":
                        writer.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 9\r\n\r\nNot Found")
                        await self._skip_chunks(reader)
                        continue
                    self.streams += 1
                    await self._stream(reader, writer)
                    return
                length = next(
                    int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")
                )
                call = json.loads(await reader.readexactly(length))
                self.singles += 1
                body = json.dumps(answer_for({"id": "x", **call})).encode()
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def _skip_chunks(self, reader: asyncio.StreamReader) -> None:
        while True:
            size = int((await reader.readuntil(b"\r\n")).strip(), 16)
            await reader.readexactly(size + 2)
            if size == 0:
                return

    async def _stream(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-type: application/x-ndjson\r\n\r\n")

        def chunk(data: bytes) -> None:
            writer.write(b"%x\r\n%s\r\n" % (len(data), data))

        async def later(delay: float, line: bytes) -> None:
            await asyncio.sleep(delay)
            chunk(line + b"\n")

        while True:
            size = int((await reader.readuntil(b"\r\n")).strip(), 16)
            data = await reader.readexactly(size + 2)
            if size == 0:
                writer.write(b"0\r\n\r\n")
                return
            for raw in data[:-2].splitlines():
                msg = json.loads(raw)
                self.lines.append(msg)
                if "abort" in msg:
                    continue
                if self.mode == "end":
                    writer.write(b"0\r\n\r\n")
                    return
                what = self.reply(msg)
                if what == "drop":
                    writer.transport.abort()
                    return
                delay, line = what
                if line is not None:
                    asyncio.ensure_future(later(delay, line))


def channel(url: str, timeout_s: float = 10.0):
    return PodChannel(url, 2.0, timeout_s)


def body(max_tokens: int = 2) -> bytes:
    return generate_body([1, 2, 3], {"max_tokens": max_tokens})


async def test_calls_share_one_stream_and_answers_come_back_out_of_order():
    def slow_first(call):
        return 0.3 if call["sampling_params"]["max_tokens"] == 9 else 0.0, json.dumps(answer_for(call)).encode()

    async with StreamPod(reply=slow_first) as pod:
        ch = channel(pod.url)
        results = await asyncio.gather(ch.generate(body(9)), ch.generate(body(2)), ch.generate(body(3)))
        ch.close()
    assert [len(r[1]["outputs"][0]["token_ids"]) for r in results] == [9, 2, 3]
    assert results[0][3] > max(results[1][3], results[2][3])  # the slow one did not hold the others back
    assert pod.streams == 1 and ch.opened == 1


async def test_a_pod_without_the_endpoint_is_a_failed_pod():
    async with StreamPod(mode="404") as pod:
        pool = PodPool([pod.url], HttpTransport(16, 10.0, 2.0), gateway_metrics())
        with pytest.raises(PodFailed, match="HTTP 404"):
            await pool.generate(pool.get(pod.url), [1, 2], {"max_tokens": 2})
        pool.close()
    assert not pool.get(pod.url).healthy and pod.singles == 0


async def test_a_dropped_stream_fails_its_calls_and_the_next_call_opens_a_new_one():
    async with StreamPod(
        reply=lambda call: (
            "drop" if call["sampling_params"]["max_tokens"] == 7 else (0.2, json.dumps(answer_for(call)).encode())
        )
    ) as pod:
        ch = channel(pod.url)
        waiting = asyncio.ensure_future(ch.generate(body(2)))
        await asyncio.sleep(0.05)
        with pytest.raises(PodConnectionError):
            await ch.generate(body(7))
        with pytest.raises(PodConnectionError):
            await waiting  # it was on the same stream: failed, never left hanging
        status, answer, _, _ = await ch.generate(body(3))
        ch.close()
    assert status == 200 and len(answer["outputs"][0]["token_ids"]) == 3 and ch.opened == 2


async def test_the_pool_marks_the_pod_unhealthy_when_its_stream_fails():
    async with StreamPod(reply=lambda call: "drop") as pod:
        pool = PodPool([pod.url], HttpTransport(16, 10.0, 2.0), gateway_metrics())
        with pytest.raises(PodFailed):
            await pool.generate(pool.get(pod.url), [1, 2], {"max_tokens": 2})
        pool.close()
    assert not pool.get(pod.url).healthy


async def test_cancelled_and_timed_out_calls_are_aborted_on_the_pod():
    async with StreamPod(reply=lambda call: (0.0, None)) as pod:  # never answers
        ch = channel(pod.url, timeout_s=0.3)
        task = asyncio.ensure_future(ch.generate(body(2)))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        with pytest.raises(PodConnectionError, match="no answer within"):
            await ch.generate(body(2))
        await asyncio.sleep(0.05)
        ch.close()
    calls = [m["id"] for m in pod.lines if "id" in m]
    aborts = [i for m in pod.lines if "abort" in m for i in m["abort"]]
    assert aborts == calls and len(calls) == 2


async def test_garbage_or_an_early_end_fails_the_calls_in_flight():
    async with StreamPod(reply=lambda call: (0.0, b"{oops")) as pod:
        ch = channel(pod.url)
        with pytest.raises(PodConnectionError, match="malformed answer line"):
            await ch.generate(body(2))
    async with StreamPod(mode="end") as pod:
        ch = channel(pod.url)
        with pytest.raises(PodConnectionError, match="ended the generate stream"):
            await ch.generate(body(2))
    with pytest.raises(PodConnectionError):  # nothing listens there any more
        await channel(pod.url).generate(body(2))
