"""POST /v1/generate_stream on a real pod (vLLM, tiny model) over loopback: many calls on one stream, each
answered when done, per-call errors, aborts, the end of the stream and a dropped connection."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import pytest
from rollout_testlib import PROMPT, ServerThread, hf_token_logprobs, max_abs_diff, tiny_settings

from services.gateway.channel import PodChannel
from services.gateway.transport import generate_body
from services.rollout.app import build_app

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def pod(tiny_qwen3):
    app = build_app(tiny_settings(tiny_qwen3))
    with ServerThread(app) as url:
        yield url, app


def _wait(cond, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


class RawStream:
    """The stream by hand: our own chunked call lines, the pod's answer lines de-chunked."""

    def __init__(self, url: str) -> None:
        host, port = url.split("://")[1].split(":")
        self.sock = socket.create_connection((host, int(port)), timeout=60)
        self.sock.sendall(b"POST /v1/generate_stream HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        self.buf = b""

    def send(self, *lines: bytes | dict) -> None:
        for line in lines:
            data = (json.dumps(line).encode() if isinstance(line, dict) else line) + b"\n"
            self.sock.sendall(b"%x\r\n%s\r\n" % (len(data), data))

    def end(self) -> None:
        self.sock.sendall(b"0\r\n\r\n")

    def answers(self) -> list[dict]:
        """Every answer line until the pod ends the response."""
        while b"\r\n0\r\n\r\n" not in self.buf:
            chunk = self.sock.recv(65536)
            assert chunk, "the pod closed the connection without ending the response"
            self.buf += chunk
        head, _, body = self.buf.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and b"chunked" in head.lower()
        data = b""
        while True:
            size, _, body = body.partition(b"\r\n")
            if int(size, 16) == 0:
                break
            data, body = data + body[: int(size, 16)], body[int(size, 16) + 2 :]
        return [json.loads(line) for line in data.splitlines()]


async def test_one_stream_carries_many_calls_each_answered_when_done(pod, tiny_qwen3):
    url, app = pod
    channel = PodChannel(url, 5.0, 60.0)
    sp = {"temperature": 1.0, "ignore_eos": True}
    try:
        calls = [
            channel.generate(generate_body(PROMPT[: 4 + i], {**sp, "max_tokens": 2 if i % 2 else 48, "seed": i}))
            for i in range(8)
        ]
        results = await asyncio.gather(*calls)
    finally:
        channel.close()
    assert channel.opened == 1  # all eight on one stream
    for i, (status, answer, _sent, _answered) in enumerate(results):
        assert status == 200, answer
        out = answer["outputs"][0]
        assert len(out["token_ids"]) == (2 if i % 2 else 48) and answer["policy_version"] == 0
        assert max_abs_diff(out["logprobs"], hf_token_logprobs(tiny_qwen3, PROMPT[: 4 + i], out["token_ids"])) < 1e-4
    # Short calls came back while the long ones in the same stream were still running.
    assert max(r[3] for r in results[1::2]) < min(r[3] for r in results[0::2])


def test_each_call_gets_its_own_error_and_an_abort_stops_one_call(pod):
    url, app = pod
    engine = app.state.engine
    aborted = engine.aborts.get("client_disconnect", 0)
    s = RawStream(url)
    s.send(
        {"id": "long", "prompt_token_ids": PROMPT, "sampling_params": {"max_tokens": 200, "ignore_eos": True}},
        {"id": "ok", "prompt_token_ids": PROMPT, "sampling_params": {"max_tokens": 3}},
        {"id": "too-long", "prompt_token_ids": PROMPT, "sampling_params": {"max_tokens": 100000}},
        {"id": "typo", "prompt_token_ids": PROMPT, "sampling_param": {}},
        {"prompt_token_ids": PROMPT},
        b"{not json",
    )
    _wait(lambda: engine.stats.running >= 1, "the long call never started")
    s.send({"abort": ["long"]})
    s.end()
    answers = {a["id"]: a for a in s.answers() if a["id"] is not None}
    nameless = [a for a in s.answers() if a["id"] is None]
    assert answers["ok"]["status"] == 200 and len(answers["ok"]["outputs"][0]["token_ids"]) == 3
    assert answers["too-long"]["status"] == 400
    assert answers["too-long"]["error"]["param"] == "sampling_params.max_tokens"
    assert answers["typo"]["status"] == 400 and answers["typo"]["error"]["code"] == "unknown_parameter"
    assert answers["long"]["status"] == 499 and answers["long"]["error"]["code"] == "aborted"
    assert sorted(a["error"]["param"] or "" for a in nameless) == ["", "id"]  # bad JSON; a call without an id
    assert engine.aborts.get("client_disconnect", 0) == aborted + 1
    s.sock.close()


def test_a_dropped_stream_aborts_its_running_calls(pod):
    url, app = pod
    engine = app.state.engine
    aborted = engine.aborts.get("client_disconnect", 0)
    s = RawStream(url)
    s.send(
        *(
            {"id": f"c{i}", "prompt_token_ids": PROMPT, "sampling_params": {"max_tokens": 200, "ignore_eos": True}}
            for i in range(3)
        )
    )
    _wait(lambda: engine.stats.running >= 3, "the calls never started")
    s.sock.close()
    _wait(
        lambda: engine.aborts.get("client_disconnect", 0) >= aborted + 3 and not engine._inflight,
        "a dropped stream left calls running",
    )
    assert (
        httpx.post(
            f"{url}/v1/generate", json={"prompt_token_ids": PROMPT, "sampling_params": {"max_tokens": 2}}, timeout=60
        ).status_code
        == 200
    )


def test_a_line_too_long_to_frame_ends_the_stream_cleanly(pod, monkeypatch):
    import services.rollout.stream as stream

    monkeypatch.setattr(stream, "MAX_LINE_BYTES", 4096)
    url, app = pod
    s = RawStream(url)
    s.send({"id": "running", "prompt_token_ids": PROMPT, "sampling_params": {"max_tokens": 200, "ignore_eos": True}})
    _wait(lambda: app.state.engine.stats.running >= 1, "the call never started")
    s.sock.sendall(b"%x\r\n%s\r\n" % (5000, b"x" * 5000))  # no newline in sight
    answers = s.answers()  # the pod ends the response by itself: no end of body was sent
    assert {a["id"]: a["status"] for a in answers} == {"running": 499, None: 400}
    assert [a["error"]["code"] for a in answers if a["id"] is None] == ["line_too_long"]
    s.sock.close()
