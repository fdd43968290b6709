"""HTTP routes of the env worker (thin: the work is in services.envs.worker)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from services.envs.worker import EpisodeRequest, EpisodeWorker, Saturated, UnknownAgent

router = APIRouter()


def _error(status: int, message: str, type_: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "code": status}}, status, headers=headers)


@router.post("/v1/episodes:run")
async def run_episode(request: Request) -> Response:
    worker: EpisodeWorker = request.app.state.worker
    try:
        req = EpisodeRequest.model_validate_json(await request.body())
    except (RequestValidationError, ValueError) as exc:
        return _error(400, f"invalid episode request: {exc}", "invalid_request_error")
    try:
        resp = await worker.run(req)
    except UnknownAgent as exc:
        return _error(404, str(exc), "not_found_error")
    except Saturated:
        retry = str(request.app.state.settings.envs.retry_after_s)
        return _error(429, f"worker saturated ({worker.max_concurrency} episodes running); retry another replica",
                      "rate_limit_error", {"Retry-After": retry})
    return JSONResponse(resp.model_dump())


@router.get("/healthz")
async def healthz() -> dict:
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(request: Request) -> Response:
    worker: EpisodeWorker = request.app.state.worker
    if not await worker.gateway.healthy():
        return _error(503, f"gateway {worker.gateway.url} is not healthy", "unavailable")
    return JSONResponse({"status": "ready", "agents": sorted(worker.runners), "inflight": worker.inflight,
                         "max_concurrency": worker.max_concurrency})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    body, content_type = request.app.state.worker.metrics.render()
    return Response(body, media_type=content_type)
