"""``build_app(settings)``: the gateway's ASGI app. Nothing happens at import time."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse

from molt.bus import TrajectoryQueue, open_queue
from services.gateway.chat import ChatModel
from services.gateway.config import GatewaySettings
from services.gateway.core import Gateway
from services.gateway.errors import GatewayError, error_body, error_headers, wire_of_path
from services.gateway.metrics import Telemetry, gateway_metrics
from services.gateway.pods import PodPool
from services.gateway.transport import HttpTransport, PodTransport
from services.gateway.routes import Handlers, routes

log = logging.getLogger("molt.gateway")


def build_app(settings: GatewaySettings, *, transport: PodTransport | None = None,
              queue: TrajectoryQueue | None = None, model: ChatModel | None = None) -> Telemetry:
    """The app for ``settings``. ``transport`` (pod HTTP) and ``queue`` are injectable for unit tests.

    The returned object is an ASGI app; the core is at ``app.gateway`` for in-process callers.
    """
    if not settings.model.path and model is None:
        raise ValueError("no model: pass --model.path DIR (the tokenizer and chat template come from it)")
    model = model or ChatModel(settings.model.path)  # type: ignore[arg-type]
    metrics = gateway_metrics()
    rc = settings.rollout
    client = transport or HttpTransport(rc.max_connections, rc.timeout_s, rc.connect_timeout_s)
    pool = PodPool(rc.urls, client, metrics, rc.health_interval_s, rc.stream)
    queue = queue or open_queue(settings.redis, metrics)
    gw = Gateway(settings, model, pool, queue, metrics)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        tasks = [asyncio.create_task(pool.health_loop()), asyncio.create_task(gw.reap_loop())]
        try:
            yield
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            pool.close()
            await client.close()
            await queue.close()

    async def on_gateway_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, GatewayError)
        return JSONResponse(error_body(exc, wire_of_path(request.url.path)), status_code=exc.status,
                            headers=error_headers(exc))

    async def on_http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, HTTPException)
        code = "not_found" if exc.status_code == 404 else "http_error"
        err = GatewayError(exc.status_code, str(exc.detail), code=code)
        return JSONResponse(error_body(err, wire_of_path(request.url.path)), status_code=exc.status_code)

    async def on_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        err = GatewayError(500, f"internal gateway error: {type(exc).__name__}: {exc}", code="internal_error")
        return JSONResponse(error_body(err, wire_of_path(request.url.path)), status_code=500)

    app = Starlette(routes=routes(Handlers(gw)), lifespan=lifespan, exception_handlers={
        GatewayError: on_gateway_error, HTTPException: on_http_error, Exception: on_error})
    wrapped = Telemetry(app, metrics, lambda: pool.policy_version)
    wrapped.gateway = gw  # type: ignore[attr-defined]
    return wrapped
