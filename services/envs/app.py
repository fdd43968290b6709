"""``build_app(settings)``: the env worker's FastAPI app (agents are loaded here, not at import time)."""

from __future__ import annotations

import contextlib

import httpx
from fastapi import FastAPI
from starlette.exceptions import HTTPException as StarletteHTTPException

from molt.agents.gateway import GatewayClient
from molt.auth import BearerGuard, denial_message, internal_token_from_env
from services.envs.config import EnvsSettings, validate_settings
from services.envs.metrics import envs_metrics, stall_counter
from services.envs.routes import http_error, router, unauthorized
from services.envs.watchdog import LoopWatchdog
from services.envs.worker import EpisodeWorker


def build_app(settings: EnvsSettings, gateway_transport: httpx.AsyncBaseTransport | None = None) -> FastAPI:
    """The worker app. ``gateway_transport`` lets unit tests reach an in-process fake gateway.

    With ``MOLT_INTERNAL_TOKEN`` set (read here) every route but the probes and /metrics needs it as a bearer
    token; without it the worker must listen on loopback or be told --server.allow_unauthenticated."""
    validate_settings(settings)
    token = internal_token_from_env()
    assert settings.gateway.url is not None  # validate_settings refuses a worker without a gateway
    gateway = GatewayClient(
        settings.gateway.url,
        settings.gateway.timeout_s,
        transport=gateway_transport,
        api_key=settings.gateway.api_key,
        finish_retry_s=settings.envs.finish_retry_s,
        lease_s=settings.envs.session_lease_s,
    )
    worker = EpisodeWorker(
        settings.agents(),
        gateway,
        envs_metrics(),
        max_concurrency=settings.envs.max_concurrency,
        episode_timeout_s=settings.envs.episode_timeout_s,
        max_new_tokens=settings.rollout.max_new_tokens,
        max_length=settings.data.max_len,
        secrets=(settings.gateway.api_key, token),
    )

    stalls = stall_counter(worker.metrics)
    stall_s = settings.envs.stall_warn_s
    watchdog = LoopWatchdog(worker, stall_s, stalls) if stall_s > 0 else None

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if watchdog is not None:
            watchdog.start()
        try:
            yield
        finally:
            if watchdog is not None:
                watchdog.stop()
            await gateway.aclose()

    app = FastAPI(title="molt env worker", lifespan=lifespan)
    app.state.settings = settings
    app.state.worker = worker
    app.include_router(router)
    if token is not None:
        app.add_middleware(BearerGuard, token=token, denial=unauthorized(denial_message("this env worker")))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc: StarletteHTTPException):  # 404/405 in this worker's error shape
        return http_error(exc.status_code, str(exc.detail), exc.headers)

    return app
