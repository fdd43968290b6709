"""The gateway's ASGI edge: routing, the one place errors become wire-shaped responses, and request timing.

Starlette's ``Router`` matches the routes, except a session's turns, found first by one dict lookup on
the path (a regex match per route tried, and the Router's scope copies, were ~8% of the gateway's CPU
per turn at concurrency 1). The rest of a Starlette app is left out on purpose. Its
middleware stack (server-error and exception middleware, plus an exception wrapper around every
endpoint) wraps ``send`` three more times per request, and its error handlers would be a second place
that maps exceptions to responses. Here one layer does it all: ``Edge`` times the request, stamps the
policy version, and answers any exception raised before the response started in the error shape of
the request's wire (routing's 404/405 included). Per-turn cost: BENCHMARKS.md "Gateway overhead".

Under the gateway's own server (services/gateway/server.py) a response's start message is held until its
first body message: a whole response then leaves in one write (``molt.send_whole``), and an error raised
before a stream's first chunk still gets the wire's error shape, since nothing has been sent yet.

Timing: added time = accept to last body byte, minus ``scope["state"]["pod_wait_s"]`` (set by handlers
to the time spent waiting on the rollout pod). Turns also get ``server-timing: gateway;dur=MS,
pod;dur=MS`` (accept to response start).
"""

from __future__ import annotations

import logging
import time
from typing import Awaitable, Callable

from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Router

from molt.metrics import Metrics
from services.gateway.errors import GatewayError, error_body, error_headers, wire_of_path
from services.gateway.metrics import UNTIMED, wire_label
from services.gateway.replicas import Replicas

log = logging.getLogger("molt.gateway")

Handler = Callable[[Request], Awaitable[Response]]
Relay = Callable[[str, dict, Callable, Callable], Awaitable[bytes | None]]
"""(replica URL, scope, receive, send): None once relayed, or the request's body to answer it here instead."""


def _replay(body: bytes, receive: Callable) -> Callable:
    """``receive`` for a request whose body was already read: the body once, then the client's own messages."""
    sent = False

    async def replay():
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


class Endpoint:
    """An ASGI app for one handler ``async (Request) -> Response``; exceptions go up to ``Edge``.

    Starlette's ``Route`` calls an endpoint that is not a plain function as an ASGI app as is, so this
    replaces its per-request wrapper (which would look up exception handlers this app does not use)."""

    __slots__ = ("handler",)

    def __init__(self, handler: Handler) -> None:
        self.handler = handler

    async def __call__(self, scope, receive, send) -> None:
        response = await self.handler(Request(scope, receive, send))
        whole = scope.get("molt.respond_whole")  # Edge's: a complete response in one call, no ASGI messages
        body = getattr(response, "body", None)  # None: a stream
        if whole is None or body is None or response.background is not None \
                or not whole(response.status_code, response.raw_headers, body):
            await response(scope, receive, send)


def error_response(exc: BaseException, path: str) -> JSONResponse:
    """What the client gets for ``exc``: a GatewayError as is, an HTTP error (404/405 from routing) with its
    status, anything else as a logged 500, each in the error body of the path's wire."""
    if isinstance(exc, GatewayError):
        err, headers = exc, error_headers(exc)
    elif isinstance(exc, HTTPException):
        code = "not_found" if exc.status_code == 404 else "http_error"
        err, headers = GatewayError(exc.status_code, str(exc.detail), code=code), dict(exc.headers or {})
    else:
        log.error("unhandled error on %s", path, exc_info=exc)
        err, headers = GatewayError(500, f"internal gateway error: {type(exc).__name__}: {exc}",
                                    code="internal_error"), {}
    return JSONResponse(error_body(err, wire_of_path(path)), status_code=err.status, headers=headers)


class Edge:
    """The whole ASGI app: ``Edge(Router(routes, lifespan=...), metrics, policy_version, replicas)``.

    A request for a session another replica holds is relayed there (services/gateway/replicas.py)."""

    def __init__(self, router: Router, metrics: Metrics, policy_version: Callable[[], int],
                 replicas: Replicas | None = None, relay: Relay | None = None,
                 session_posts: dict[str, Endpoint] | None = None) -> None:
        self.router = router
        self.session_posts = session_posts or {}
        """POST ``/s/{sid}`` + key -> endpoint: the turns, found by one dict lookup instead of the Router's regex
        matches (``_dispatch``); the Router holds the same routes."""
        self.replicas = replicas or Replicas("", [])
        self.relay = relay  # a session another replica holds (``Relay``)
        self.metrics = metrics
        self.policy_version = policy_version
        self.requests = metrics["molt_gateway_requests_total"]
        self.errors = metrics["molt_gateway_errors_total"]
        self.added = metrics["molt_gateway_added_latency_seconds"]
        self.total = metrics["molt_gateway_request_seconds"]
        # The per-request series are lock-free (services/gateway/metrics.py); their children are
        # looked up once per (wire, status) and kept.
        self._children: dict[tuple[str, int], tuple] = {}

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":  # lifespan
            await self.router(scope, receive, send)
            return
        t0 = time.perf_counter()
        path = scope["path"]
        state = scope.setdefault("state", {})
        scope["app"] = self  # routing then raises HTTPException for 404/405, answered below in the wire's shape
        status = 0
        started = False  # the response's first bytes have left: an error can no longer replace it
        held: dict | None = None  # a start message whose body may follow at once (see below)
        send_whole = scope.get("extensions", {}).get("molt.send_whole")

        def edge_headers(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
            """A response's headers plus the edge's, as it starts: the policy version unless the handler set it,
            and for a turn how the time split (standard Server-Timing header)."""
            extra = [] if any(k == b"x-molt-policy-version" for k, _ in headers) else [
                (b"x-molt-policy-version", b"%d" % self.policy_version())]
            if "pod_wait_s" in state:
                total_ms = (time.perf_counter() - t0) * 1e3
                pod_ms = state["pod_wait_s"] * 1e3
                extra.append((b"server-timing", b"gateway;dur=%.3f, pod;dur=%.3f" % (total_ms - pod_ms, pod_ms)))
            return [*headers, *extra] if extra else headers

        def respond_whole(code: int, headers: list[tuple[bytes, bytes]], body: bytes) -> bool:
            """A complete response in one write through the server's ``molt.send_whole``, without the two ASGI
            messages (``Endpoint`` uses it); False, nothing done, when it must go as messages instead."""
            nonlocal status, started
            if send_whole is None or started or not send_whole(code, edge_headers(headers), body):
                return False
            status, started = code, True
            self._record("relay" if state.get("relayed") else wire_label(path), path, code,
                         time.perf_counter() - t0, state.get("pod_wait_s", 0.0))
            return True

        scope["molt.respond_whole"] = respond_whole

        async def timed_send(message) -> None:
            nonlocal status, started, held
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {**message, "headers": edge_headers(message.get("headers", []))}
                if send_whole is not None:  # the server can write start and body at once: wait for the body
                    held = message
                    return
                started = True
                await send(message)
            elif held is not None:
                start, held = held, None
                if message.get("more_body", False) or not send_whole(status, start["headers"], message.get("body", b"")):
                    started = True
                    await send(start)
                    await send(message)
            else:
                started = True
                await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                started = True
                self._record("relay" if state.get("relayed") else wire_label(path), path, status,
                             time.perf_counter() - t0, state.get("pod_wait_s", 0.0))

        try:
            owner = self.replicas.target(scope) if self.relay else None
            if owner is not None:  # "" included: a session of this replica's that it does not hold
                body = await self.relay(owner, scope, receive, timed_send)  # type: ignore[misc]
                if body is not None:  # the owner was gone and this replica adopted the session: answered here
                    await self._dispatch(scope, _replay(body, receive), timed_send)
            else:
                await self._dispatch(scope, receive, timed_send)
        except ClientDisconnect:
            return  # the client left before its request body had arrived: there is no one to answer
        except Exception as exc:
            if started:  # the response has started (a stream): nothing can be sent in its place
                raise
            await error_response(exc, path)(scope, receive, timed_send)

    async def _dispatch(self, scope, receive, send) -> None:
        """A session's POST routes (the turns) by a dict lookup, with the scope the Router would give them;
        everything else, a trailing slash or another method included, through the Router."""
        path = scope["path"]
        if path[:3] == "/s/" and scope["method"] == "POST" and not scope.get("root_path"):
            cut = path.find("/", 3)
            endpoint = self.session_posts.get(path[cut:]) if cut > 3 else None
            if endpoint is not None:
                scope["path_params"] = {"sid": path[3:cut]}
                scope["endpoint"] = endpoint
                await endpoint(scope, receive, send)
                return
        await self.router(scope, receive, send)

    def _record(self, wire: str, path: str, status: int, total_s: float, pod_wait_s: float) -> None:
        if path in UNTIMED:
            return
        children = self._children.get((wire, status))
        if children is None:
            children = (self.requests.labels(wire, str(status)),
                        self.errors.labels(str(status)) if status >= 400 else None,
                        self.total.labels(wire), self.added.labels(wire))
            self._children[(wire, status)] = children
        requests, errors, total, added = children
        requests.inc()
        if errors is not None:
            errors.inc()
        total.observe(total_s)
        added.observe(max(0.0, total_s - pod_wait_s))
