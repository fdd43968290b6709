"""POST /v1/generate_stream: one long-lived, full-duplex request that carries many generate calls.

A gateway that fans in many agents keeps one such request open per pod. It writes each call as one
NDJSON line of its (chunked) request body the moment the call is ready, and reads each answer as one
NDJSON line of the response the moment that call is done, so nothing waits for company and a short
answer never waits for a long one. Compared with one HTTP request per call, the pod's event loop
skips the per-request HTTP parsing, routing and response framing, and calls that arrive together are
read together and join the same engine step.

Lines in (request body):

    {"id": "a1-17", "prompt_token_ids": [...], "sampling_params": {...}}   a call (what /v1/generate takes, plus an id)
    {"id": "a1-19", ..., "stream": true}                                  a call whose tokens are streamed (n = 1)
    {"abort": ["a1-17", ...]}                                             stop calls whose callers went away

Lines out (response body), in completion order:

    {"id": "a1-17", "status": 200, "request_id": ..., "policy_version": 3, "outputs": [...]}
    {"id": "a1-18", "status": 400, "error": {"message": ..., "type": ..., "param": ..., "code": ...}}
    {"id": "a1-19", "delta": {"token_ids": [...], "logprobs": [...]}}     a streamed call's tokens of one engine step

A streamed call gets a delta line after each engine step that gave it tokens, then its answer line as usual
(which holds all its tokens again: the deltas are for showing progress, the answer is the record).

Each answer is what ``/v1/generate`` says for that call, plus its id and HTTP status; a bad call gets
its own 4xx line and never disturbs the others (an aborted call: 499). When the client ends its body,
the pod answers what is still running and then ends the response; when the connection drops, every
unfinished call is aborted in the engine.
"""

from __future__ import annotations

import asyncio
import json

from fastapi import Request, Response

from molt.body_limit import own_body_limit
from molt.net import LineSplitter
from services.rollout.params import RolloutInputError
from services.rollout.routes import call_options, result_json

CALL_KEYS = {"id", "prompt_token_ids", "sampling_params", "stream", "images", "return_routed_experts"}
MAX_LINE_BYTES = 64 << 20
"""A call line longer than this (a prompt of millions of tokens) is refused, and so is the stream."""


def _error(exc: BaseException) -> tuple[int, dict, str]:
    """(HTTP status, OpenAI error object, request-counter status), as app.py maps the same errors for /v1/generate."""
    if isinstance(exc, RolloutInputError):
        return (
            400,
            {"message": str(exc), "type": "invalid_request_error", "param": exc.param, "code": exc.code},
            "bad_request",
        )
    if isinstance(exc, asyncio.CancelledError):
        return (
            499,
            {"message": "aborted by the caller", "type": "invalid_request_error", "param": None, "code": "aborted"},
            "client_disconnect",
        )
    if isinstance(exc, ValueError):
        return 400, {"message": str(exc), "type": "invalid_request_error", "param": None, "code": None}, "bad_request"
    if isinstance(exc, RuntimeError):
        return 503, {"message": str(exc), "type": "server_error", "param": None, "code": "engine_error"}, "error"
    return (
        500,
        {"message": f"{type(exc).__name__}: {exc}", "type": "server_error", "param": None, "code": "internal_error"},
        "error",
    )


def _check_call(call: object) -> tuple[str | None, RolloutInputError | None]:
    """(the call's id, what is wrong with the line or None); the id is None where the line has none."""
    if not isinstance(call, dict):
        return None, RolloutInputError('each line must be a JSON object: a call or {"abort": [ids]}', param=None)
    call_id = call.get("id")
    if not isinstance(call_id, str) or not call_id:
        return None, RolloutInputError(
            "a call needs a non-empty string 'id' (its answer line carries it back)", param="id"
        )
    unknown = sorted(set(call) - CALL_KEYS)
    if unknown:
        return call_id, RolloutInputError(
            f"unknown field(s) {ascii(unknown)[:200]}; expected {sorted(CALL_KEYS)}",
            param=ascii(unknown[0])[1:-1][:80],
            code="unknown_parameter",
        )
    return call_id, None


# One request per gateway for as long as it runs: each line is bounded (MAX_LINE_BYTES), not the whole body.
@own_body_limit
async def generate_stream(request: Request) -> Response:
    return _Stream(request.app.state.engine, request.app.state.metrics)


class _Stream(Response):
    media_type = "application/x-ndjson"

    def __init__(self, engine, metrics) -> None:
        super().__init__(media_type=self.media_type)
        self.engine, self.metrics = engine, metrics
        self.calls: dict[str, asyncio.Future] = {}
        self.out: list[bytes] = []
        self.wake = asyncio.Event()
        self.input_done = False
        self.gone = False

    # ---- answers

    def _answer(self, call_id: str | None, task: asyncio.Future) -> None:
        if call_id is not None and self.calls.get(call_id) is task:
            del self.calls[call_id]
        exc = asyncio.CancelledError() if task.cancelled() else task.exception()
        if exc is None:
            result = task.result()
            self.metrics.request_done("ok", result.prompt_token_count, sum(len(s.token_ids) for s in result.samples))
            payload = {"id": call_id, "status": 200, **result_json(result)}
        else:
            status, error, counter = _error(exc)
            self.metrics.request_done(counter)
            payload = {"id": call_id, "status": status, "error": error}
        self.out.append(json.dumps(payload, separators=(",", ":")).encode() + b"\n")
        self.wake.set()

    def _refuse(self, call_id: str | None, exc: BaseException) -> None:
        failed: asyncio.Future = asyncio.get_running_loop().create_future()
        failed.set_exception(exc)
        self._answer(call_id, failed)

    # ---- calls in

    def _line(self, line: bytes) -> None:
        try:
            msg = json.loads(line)
        except (ValueError, RecursionError) as exc:  # RecursionError: nested past Python's stack
            self._refuse(
                None, RolloutInputError(f"a line is not valid JSON: {str(exc)[:200]}", param=None, code="invalid_json")
            )
            return
        if isinstance(msg, dict) and "abort" in msg and "id" not in msg:
            ids = msg["abort"]
            for call_id in ids if isinstance(ids, list) else []:
                task = self.calls.get(call_id) if isinstance(call_id, str) else None
                if task is not None:
                    task.cancel()  # RolloutEngine.generate aborts the engine requests; the answer says 499
            return
        call_id, bad = _check_call(msg)
        if bad is not None:
            self._refuse(call_id, bad)
            return
        assert call_id is not None  # _check_call found the line good, so it has an id
        if call_id in self.calls:
            self._refuse(
                call_id, RolloutInputError(f"call id {call_id!r} is already running on this stream", param="id")
            )
            return
        streamed = {}
        if msg.get("stream") is True:

            def on_tokens(ids: list[int], logprobs: list[float], call_id: str = call_id) -> None:
                self.out.append(
                    b'{"id":%s,"delta":%s}\n'
                    % (
                        json.dumps(call_id).encode(),
                        json.dumps({"token_ids": ids, "logprobs": logprobs}, separators=(",", ":")).encode(),
                    )
                )
                self.wake.set()

            streamed["on_tokens"] = on_tokens
        try:
            streamed.update(call_options(msg))  # images (vision-language models), return_routed_experts (MoE)
        except RolloutInputError as exc:
            self._refuse(call_id, exc)
            return
        task = asyncio.ensure_future(
            self.engine.generate(msg.get("prompt_token_ids"), msg.get("sampling_params"), **streamed)
        )
        self.calls[call_id] = task
        task.add_done_callback(lambda t, call_id=call_id: self._answer(call_id, t))

    async def _read(self, receive) -> None:
        lines = LineSplitter()
        try:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    self.gone = True
                    return
                for line in lines.feed(message.get("body", b"")):
                    self._line(line)
                if lines.pending_bytes > MAX_LINE_BYTES:  # the rest cannot be framed: answer what runs, then end
                    self._refuse(
                        None,
                        RolloutInputError(
                            f"a line is longer than {MAX_LINE_BYTES} bytes", param=None, code="line_too_long"
                        ),
                    )
                    for task in list(self.calls.values()):
                        task.cancel()
                    return
                if not message.get("more_body", False):
                    last = lines.rest()
                    if last.strip():
                        self._line(last)
                    return
        finally:
            self.input_done = True
            self.wake.set()

    # ---- ASGI

    async def __call__(self, scope, receive, send) -> None:
        reader = asyncio.ensure_future(self._read(receive))
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", self.media_type.encode())],
                }
            )
            while True:
                await self.wake.wait()
                self.wake.clear()
                if self.gone:
                    return  # the finally block aborts what is still running
                if self.out:
                    lines, self.out = self.out, []
                    await send({"type": "http.response.body", "body": b"".join(lines), "more_body": True})
                if self.input_done and not self.calls and not self.out:
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                    return
        finally:
            reader.cancel()
            for task in list(self.calls.values()):
                task.cancel()
