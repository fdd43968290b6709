"""``BodyLimit``: the request-body size limit (``--server.max_body_bytes``) every service but the gateway has.

A pure ASGI middleware that ``molt.serve.uvicorn_config`` wraps around a service's app. Without it a handler's
``await request.body()`` buffers whatever a client sends. A declared ``Content-Length`` over the limit is
answered 413 before the app runs (nothing of the body is read); a body without one (chunked) is counted as
the app reads it, and the request is cut with 413 as soon as it passes the limit. The 413 is rendered by the
app's own handler for HTTP errors (the one routing's 404/405 go through), so it is in the service's error
shape; an app without one gets ``{"error": {"message", "type", "code"}}``.

A route whose body is a long-lived stream that bounds its own pieces (the rollout pod's /v1/generate_stream:
one request per gateway for as long as it runs, each NDJSON line at most ``MAX_LINE_BYTES``) is marked with
``own_body_limit`` and passes through uncounted.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

FLAG = "--server.max_body_bytes"
_OWN = "__molt_own_body_limit__"

_F = TypeVar("_F", bound=Callable[..., Any])


def own_body_limit(endpoint: _F) -> _F:
    """Marks a route endpoint that reads its body as a stream and bounds it itself: ``BodyLimit`` lets it by."""
    setattr(endpoint, _OWN, True)
    return endpoint


class BodyTooLarge(BaseException):
    """Raised into the app from ``receive`` once a streamed body passes the limit. A BaseException, as
    CancelledError is: the app's own handlers (a catch-all one would log it and answer 500) leave it to
    ``BodyLimit``, which answers 413."""


class BodyLimit:
    """``BodyLimit(app, max_bytes)``: refuses request bodies over ``max_bytes`` with 413 (module docstring)."""

    def __init__(self, app: ASGIApp, max_bytes: int, flag: str = FLAG) -> None:
        if max_bytes <= 0:
            raise ValueError(f"{flag} must be > 0, got {max_bytes}")
        self.app = app
        self.max_bytes = max_bytes
        self.flag = flag
        self._own: list[Any] | None = None  # the app's routes marked own_body_limit, found on the first request

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # lifespan
            await self.app(scope, receive, send)
            return
        declared, chunked = None, False
        for name, value in scope["headers"]:
            if name == b"content-length":
                declared = int(value) if value.isdigit() else None
            elif name == b"transfer-encoding":
                chunked = True
        # A declared length within the limit needs no counting: the HTTP parser delivers exactly that many bytes.
        if (declared is not None and declared <= self.max_bytes and not chunked) or self._owns_limit(scope):
            await self.app(scope, receive, send)
            return
        if declared is not None and declared > self.max_bytes:
            await self._refuse(scope, receive, send, f"request body of {declared} bytes")
            return
        await self._counted(scope, receive, send)

    async def _counted(self, scope: Scope, receive: Receive, send: Send) -> None:
        size = 0
        refused = started = False

        async def counting() -> Message:
            nonlocal size, refused
            if refused:
                raise BodyTooLarge
            message = await receive()
            if message["type"] == "http.request":
                size += len(message.get("body", b""))
                if size > self.max_bytes:
                    refused = True
                    raise BodyTooLarge
            return message

        async def sending(message: Message) -> None:
            nonlocal started
            if refused:  # whatever the app answers once its body was cut, the 413 replaces it
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting, sending)
        except BaseException as exc:  # the app may let BodyTooLarge out as is, in a group, or as another error
            # A response that has begun cannot be replaced (the connection is cut), and a shutdown goes on.
            if not refused or started or isinstance(exc, (asyncio.CancelledError, KeyboardInterrupt, SystemExit)):
                raise
        if refused and not started:
            await self._refuse(scope, receive, send, "request body")

    def _owns_limit(self, scope: Scope) -> bool:
        if self._own is None:
            routes = getattr(self.app, "routes", None) or ()
            self._own = [r for r in routes if getattr(getattr(r, "endpoint", None), _OWN, False)]
        return any(route.matches(scope)[0] is Match.FULL for route in self._own)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, what: str) -> None:
        message = f"{what} is over the {self.max_bytes}-byte limit; raise {self.flag} to accept it"
        response = await self._render(scope, message)
        await response(scope, receive, send)

    async def _render(self, scope: Scope, message: str) -> Response:
        """The 413 as the app words its HTTP errors (its ``exception_handlers`` entry for HTTPException)."""
        handlers = getattr(self.app, "exception_handlers", None) or {}
        handler = handlers.get(HTTPException)
        if handler is not None:
            response = handler(Request(scope), HTTPException(413, message))
            if inspect.isawaitable(response):
                response = await response
            if isinstance(response, Response):
                return response
        error = {"message": message, "type": "invalid_request_error", "code": "request_too_large"}
        return JSONResponse({"error": error}, 413)
