"""``build_app(settings)``: a rollout pod's FastAPI app. The engine starts in the lifespan, not at import."""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

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


async def _start_weightsync(app: FastAPI, engine: RolloutEngine, settings: RolloutSettings) -> None:
    """Hook the gRPC weight-sync receiver in when it is built and --grpc.port is set."""
    app.state.grpc_server, app.state.grpc_port = None, None
    if not settings.grpc.port:
        return
    if importlib.util.find_spec("molt.weightsync.server") is None:
        log.error("--grpc.port %d set but molt.weightsync.server is not installed; gRPC weight sync is off",
                  settings.grpc.port)
        return
    from molt.weightsync.server import start_weightsync_server

    kwargs = {}
    if "metrics" in inspect.signature(start_weightsync_server).parameters:  # share the pod's /metrics registry
        kwargs["metrics"] = app.state.metrics.metrics
    started = start_weightsync_server(engine, settings.server.host, settings.grpc.port, **kwargs)
    if inspect.isawaitable(started):
        started = await started
    app.state.grpc_server, app.state.grpc_port = started
    log.info("gRPC weight sync on %s:%s", settings.server.host, app.state.grpc_port)


def build_app(settings: RolloutSettings, engine: RolloutEngine | None = None) -> FastAPI:
    """The pod app; the engine (``RolloutEngine(settings)`` unless given) starts in the lifespan."""
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
                stopped = server.stop(1.0)
                if inspect.isawaitable(stopped):
                    await stopped
            await engine.close()

    app = FastAPI(title="molt rollout pod", lifespan=lifespan)
    app.state.settings = settings
    app.state.engine = engine
    app.state.metrics = RolloutMetrics()
    app.state.grpc_server, app.state.grpc_port = None, None
    app.router.add_route("/v1/generate", generate, methods=["POST"])
    app.router.add_route("/v1/generate_stream", generate_stream, methods=["POST"])
    app.include_router(router)

    @app.exception_handler(RolloutInputError)
    async def _input_error(request: Request, exc: RolloutInputError):
        app.state.metrics.request_done("bad_request")
        return JSONResponse(error_body(str(exc), "invalid_request_error", exc.param, exc.code), status_code=400)

    @app.exception_handler(ValueError)
    async def _value_error(request: Request, exc: ValueError):
        return JSONResponse(error_body(str(exc), "invalid_request_error"), status_code=400)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        body = error_body(str(exc.errors()), "invalid_request_error", code="invalid_body")
        return JSONResponse(body, status_code=400)

    @app.exception_handler(RuntimeError)
    async def _engine_error(request: Request, exc: RuntimeError):
        log.error("request failed: %r", exc)
        app.state.metrics.request_done("error")
        return JSONResponse(error_body(str(exc), "server_error", code="engine_error"), status_code=503)

    return app
