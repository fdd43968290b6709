"""The gateway's ASGI edge: one middleware in front of Starlette's app, and the one place errors become
wire-shaped responses.

``Edge`` (a plain ASGI middleware) relays a request for a session another replica holds
(services/gateway/replicas.py), times every request, stamps the policy version on every answer, bounds the
wait for each piece of a request body (a 408 past ``--server.body_timeout_s``: slow clients cannot hold a
request open) and turns any exception raised before the response started into the error body of the
request's wire.
``error_response`` is that mapping; Starlette's app uses it too, as its handler for routing's 404/405.

Timing: added time = accept to last body byte, minus ``scope["state"]["pod_wait_s"]`` (set by handlers
to the time spent waiting on the rollout pod). Turns also get ``server-timing: gateway;dur=MS,
pod;dur=MS`` (accept to response start).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from molt.metrics import Metrics
from services.gateway.errors import GatewayError, error_body, error_headers, wire_of_path
from services.gateway.metrics import UNTIMED, wire_label
from services.gateway.replicas import Replicas

log = logging.getLogger("molt.gateway")

Relay = Callable[[str, Scope, Receive, Send], Awaitable[bytes | None]]
"""(replica URL, scope, receive, send): None once relayed, or the request's body to answer it here instead."""


def _replay(body: bytes, receive: Receive) -> Receive:
    """``receive`` for a request whose body was already read: the body once, then the client's own messages."""
    sent = False

    async def replay():
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


def _bounded(receive: Receive, timeout_s: float) -> Receive:
    """``receive`` whose request-body messages must each arrive within ``timeout_s``; once the body is complete
    (the rest is waiting for a disconnect, which may take as long as a stream lasts) it is unbounded."""
    complete = False

    async def bounded():
        nonlocal complete
        if complete:
            return await receive()
        try:
            async with asyncio.timeout(timeout_s):
                message = await receive()
        except TimeoutError:
            raise GatewayError(
                408, f"the request body did not arrive within {timeout_s:g} s", code="request_timeout"
            ) from None
        complete = message["type"] != "http.request" or not message.get("more_body", False)
        return message

    return bounded


def error_response(exc: BaseException, path: str) -> JSONResponse:
    """What the client gets for ``exc``: a GatewayError as is, an HTTP error (404/405 from routing) with its
    status, anything else as a logged 500, each in the error body of the path's wire."""
    if isinstance(exc, GatewayError):
        err, headers = exc, error_headers(exc)
    elif isinstance(exc, HTTPException):
        code = "not_found" if exc.status_code == 404 else "http_error"
        detail = str(exc.detail)
        if exc.status_code == 404 and path.startswith("/s/"):
            # Clients join paths to a base URL their own way (dspy posts to {base}/messages): say which bases.
            detail += (
                f": nothing is served at {path[:200]}; a session's OpenAI base URL is /s/{{id}}/v1 (chat/completions, "
                "completions, responses, models) and its Anthropic base URL /s/{id} (the SDK adds /v1/messages)"
            )
        err, headers = GatewayError(exc.status_code, detail, code=code), dict(exc.headers or {})
    else:
        log.error("unhandled error on %s", path, exc_info=exc)
        err, headers = (
            GatewayError(500, f"internal gateway error: {type(exc).__name__}: {exc}", code="internal_error"),
            {},
        )
    return JSONResponse(error_body(err, wire_of_path(path)), status_code=err.status, headers=headers)


async def http_error(request: Request, exc: Exception) -> JSONResponse:
    """Starlette's handler for routing's HTTPExceptions (404, 405): the wire's error shape."""
    return error_response(exc, request.url.path)


class Edge:
    """ASGI middleware: ``Middleware(Edge, metrics=..., policy_version=..., replicas=..., relay=...)``."""

    def __init__(
        self,
        app: ASGIApp,
        metrics: Metrics,
        policy_version: Callable[[], int],
        replicas: Replicas | None = None,
        relay: Relay | None = None,
        body_timeout_s: float = 60.0,
    ) -> None:
        self.app = app
        self.body_timeout_s = body_timeout_s
        self.replicas = replicas or Replicas("", [])
        self.relay = relay  # a session another replica holds (``Relay``)
        self.policy_version = policy_version
        self.requests = metrics["molt_gateway_requests_total"]
        self.errors = metrics["molt_gateway_errors_total"]
        self.added = metrics["molt_gateway_added_latency_seconds"]
        self.total = metrics["molt_gateway_request_seconds"]
        # The per-request series are lock-free (services/gateway/metrics.py); their children are
        # looked up once per (wire, status) and kept.
        self._children: dict[tuple[str, int], tuple] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # lifespan
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        path = scope["path"]
        state = scope.setdefault("state", {})
        status = 0
        started = False  # the response's first bytes have left: an error can no longer replace it
        receive = _bounded(receive, self.body_timeout_s)

        async def timed_send(message) -> None:
            nonlocal status, started
            if message["type"] == "http.response.start":
                status, started = message["status"], True
                message = {**message, "headers": self._headers(message.get("headers", []), state, t0)}
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                self._record(
                    "relay" if state.get("relayed") else wire_label(path),
                    path,
                    status,
                    time.perf_counter() - t0,
                    state.get("pod_wait_s", 0.0),
                )

        try:
            relay = self.relay
            owner = self.replicas.target(scope) if relay else None
            if relay is not None and owner is not None:  # "" included: a session of this replica's it does not hold
                body = await relay(owner, scope, receive, timed_send)
                if body is None:
                    return
                receive = _replay(body, receive)  # the owner was gone and this replica adopted the session
            await self.app(scope, receive, timed_send)
        except ClientDisconnect:
            return  # the client left before its request body had arrived: there is no one to answer
        except Exception as exc:
            if started:  # the response has started (a stream): nothing can be sent in its place
                raise
            await error_response(exc, path)(scope, receive, timed_send)

    def _headers(self, headers: list[tuple[bytes, bytes]], state: dict, t0: float) -> list[tuple[bytes, bytes]]:
        """A response's headers plus the edge's: the policy version unless the handler set it, and for a turn how
        the time split (standard Server-Timing header)."""
        extra = (
            []
            if any(k == b"x-molt-policy-version" for k, _ in headers)
            else [(b"x-molt-policy-version", b"%d" % self.policy_version())]
        )
        if "pod_wait_s" in state:
            total_ms = (time.perf_counter() - t0) * 1e3
            pod_ms = state["pod_wait_s"] * 1e3
            extra.append((b"server-timing", b"gateway;dur=%.3f, pod;dur=%.3f" % (total_ms - pod_ms, pod_ms)))
        return [*headers, *extra] if extra else headers

    def _record(self, wire: str, path: str, status: int, total_s: float, pod_wait_s: float) -> None:
        if path in UNTIMED:
            return
        children = self._children.get((wire, status))
        if children is None:
            children = (
                self.requests.labels(wire, str(status)),
                self.errors.labels(str(status)) if status >= 400 else None,
                self.total.labels(wire),
                self.added.labels(wire),
            )
            self._children[(wire, status)] = children
        requests, errors, total, added = children
        requests.inc()
        if errors is not None:
            errors.inc()
        total.observe(total_s)
        added.observe(max(0.0, total_s - pod_wait_s))
