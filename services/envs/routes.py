"""HTTP routes of the env worker (thin: the work is in services.envs.worker)."""

from __future__ import annotations

import json
from collections.abc import Mapping

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from services.envs.worker import EpisodeRequest, EpisodeWorker, Saturated, UnknownAgent, Unsupported

router = APIRouter()


def _error(status: int, message: str, type_: str, headers: Mapping[str, str] | None = None) -> Response:
    """This worker's error shape, as ASCII JSON (a message quoting a client's lone surrogate still encodes)."""
    body = json.dumps({"error": {"message": message, "type": type_, "code": status}}, ensure_ascii=True)
    return Response(body, status, headers=headers, media_type="application/json")


def http_error(status: int, detail: str, headers: Mapping[str, str] | None = None) -> Response:
    """Routing's own errors (404, 405)."""
    return _error(status, detail, "not_found_error" if status == 404 else "invalid_request_error", headers)


def unauthorized(message: str) -> Response:
    """The 401 of a request without the service token (molt/auth.py ``BearerGuard``)."""
    return _error(401, message, "authentication_error", {"WWW-Authenticate": "Bearer"})


@router.post("/v1/episodes:run")
async def run_episode(request: Request) -> Response:
    worker: EpisodeWorker = request.app.state.worker
    try:
        req = EpisodeRequest.model_validate_json(await request.body())
    except (RequestValidationError, ValueError, RecursionError) as exc:
        return _error(400, f"invalid episode request: {str(exc)[:2000]}", "invalid_request_error")
    try:
        resp = await worker.run(req)
    except UnknownAgent as exc:
        return _error(404, str(exc), "not_found_error")
    except Unsupported as exc:
        return _error(400, str(exc), "invalid_request_error")
    except Saturated:
        retry = str(request.app.state.settings.envs.retry_after_s)
        return _error(
            429,
            f"worker saturated ({worker.max_concurrency} episodes running); retry another replica",
            "rate_limit_error",
            {"Retry-After": retry},
        )
    if resp.status == "unavailable":  # an outage, not this episode's fault: the caller waits and sends it again
        retry = str(request.app.state.settings.envs.retry_after_s)
        return _error(503, f"episode stopped by an outage: {resp.error}", "unavailable", {"Retry-After": retry})
    return JSONResponse(resp.model_dump())


# Both probes answer from the event loop on purpose: while agent code blocks it they fail, so the pod leaves the
# Service (/readyz, ~15 s in the chart) and is then restarted (/healthz, once --envs.session_lease_s has lapsed and
# the gateway has closed this worker's sessions anyway: the chart derives the window from the lease; a deadlock
# recovers no other way). A /healthz served from another thread would keep a deadlocked worker alive; the loop
# watchdog logs who blocked it first.
@router.get("/healthz")
async def healthz() -> dict:
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(request: Request) -> Response:
    worker: EpisodeWorker = request.app.state.worker
    if not await worker.gateway.healthy(ready=True):  # e.g. its Redis is down: episodes could not be finished
        return _error(503, f"gateway {worker.gateway.url} is not ready", "unavailable")
    limits = request.app.state.settings.envs
    # The trainer's dispatcher reads the limits to wait long enough for each episode's answer
    # (services/trainer/dispatch.py), so they are set once, on the workers.
    return JSONResponse(
        {
            "status": "ready",
            "agents": sorted(worker.runners),
            "inflight": worker.inflight,
            "max_concurrency": worker.max_concurrency,
            "episode_timeout_s": limits.episode_timeout_s,
            "finish_retry_s": limits.finish_retry_s,
        }
    )


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    body, content_type = request.app.state.worker.metrics.render()
    return Response(body, media_type=content_type)
