"""``build_app(settings)``: a rollout pod's FastAPI app. The engine starts in the lifespan, not at import."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Mapping

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from molt.auth import OPEN_PATHS, BearerGuard, denial_message, internal_token_from_env
from molt.weightsync.auth import check_exposure, server_credentials, token_from_env
from services.rollout.config import RolloutSettings
from services.rollout.engine import RolloutEngine
from services.rollout.metrics import RolloutMetrics
from services.rollout.params import RolloutInputError
from services.rollout.routes import generate, router
from services.rollout.stream import generate_stream

log = logging.getLogger("molt.rollout")


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    """The OpenAI error shape, used for every error this pod returns."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(
    status: int,
    message: str,
    type_: str,
    param: str | None = None,
    code: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> Response:
    """An error body as ASCII JSON: a message that quotes a client's lone surrogate still encodes."""
    body = json.dumps(error_body(message, type_, param, code), ensure_ascii=True, separators=(",", ":"))
    return Response(body, status_code=status, media_type="application/json", headers=headers)


async def _start_weightsync(app: FastAPI, engine: RolloutEngine, settings: RolloutSettings) -> None:
    """Start the gRPC weight-sync receiver when --grpc.port is set; it shares the pod's /metrics registry."""
    app.state.grpc_server, app.state.grpc_port = None, None
    if not settings.grpc.port:
        return
    from molt.weightsync.server import start_weightsync_server

    g = settings.grpc
    app.state.grpc_server, app.state.grpc_port = await start_weightsync_server(
        engine,
        settings.server.host,
        g.port,
        metrics=app.state.metrics.metrics,
        token=app.state.weights_token,
        allow_unauthenticated=settings.weights.allow_unauthenticated,
        credentials=server_credentials(g.tls_cert, g.tls_key, g.tls_client_ca),
    )
    log.info("gRPC weight sync on %s:%s", settings.server.host, app.state.grpc_port)


def build_app(settings: RolloutSettings, engine: RolloutEngine | None = None) -> FastAPI:
    """The pod app; the engine (``RolloutEngine(settings)`` unless given) starts in the lifespan.

    Weight changes need ``MOLT_WEIGHTS_TOKEN`` (read here); without it the pod must listen on loopback
    or be told --weights.allow_unauthenticated (ValueError otherwise, before anything starts). With
    ``MOLT_INTERNAL_TOKEN`` set (read here) every other route but the probes and /metrics needs it as a bearer
    token (start-up refuses a public address without it: ``validate_settings``).
    """
    weights_token = token_from_env()
    check_exposure(weights_token, settings.server.host, settings.weights.allow_unauthenticated)
    engine = engine if engine is not None else RolloutEngine(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await engine.start()
        await _start_weightsync(app, engine, settings)
        try:
            yield
        finally:
            server = app.state.grpc_server
            if server is not None:
                await server.stop(1.0)
            await engine.close()

    app = FastAPI(title="molt rollout pod", lifespan=lifespan)
    app.state.settings = settings
    app.state.engine = engine
    app.state.metrics = RolloutMetrics()
    app.state.grpc_server, app.state.grpc_port = None, None
    app.state.weights_token = weights_token
    app.router.add_route("/v1/generate", generate, methods=["POST"])
    app.router.add_route("/v1/generate_stream", generate_stream, methods=["POST"])
    app.include_router(router)
    internal_token = internal_token_from_env()
    if internal_token is not None:
        # The weight reload checks its own token (the trainer's) where there is one; everything else a caller
        # uses needs this one. Without a weights token (--weights.allow_unauthenticated) the reload, which loads
        # any path the caller names, stays behind this token rather than open to the whole network.
        denial = error_response(
            401,
            denial_message("this pod"),
            "authentication_error",
            code="invalid_internal_token",
            headers={"WWW-Authenticate": "Bearer"},
        )
        open_paths = (*OPEN_PATHS, "/v1/weights/reload") if weights_token is not None else OPEN_PATHS
        app.add_middleware(BearerGuard, token=internal_token, denial=denial, open_paths=open_paths)

    @app.exception_handler(RolloutInputError)
    async def _input_error(request: Request, exc: RolloutInputError):
        app.state.metrics.request_done("bad_request")
        return error_response(400, str(exc), "invalid_request_error", exc.param, exc.code)

    @app.exception_handler(ValueError)
    async def _value_error(request: Request, exc: ValueError):
        return error_response(400, str(exc), "invalid_request_error")

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        return error_response(400, str(exc.errors()), "invalid_request_error", code="invalid_body")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):  # 404, 405: the same error shape
        return error_response(
            exc.status_code,
            str(exc.detail),
            "invalid_request_error",
            code="method_not_allowed" if exc.status_code == 405 else "not_found" if exc.status_code == 404 else None,
            headers=exc.headers,
        )

    @app.exception_handler(RuntimeError)
    async def _engine_error(request: Request, exc: RuntimeError):
        log.error("request failed: %r", exc)
        app.state.metrics.request_done("error")
        return error_response(503, str(exc), "server_error", code="engine_error")

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):  # a bug: logged, and still this pod's error shape
        log.exception("request failed")
        app.state.metrics.request_done("error")
        return error_response(500, f"{type(exc).__name__}: {exc}", "server_error", code="internal_error")

    return app
