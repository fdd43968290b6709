"""HTTP surface of the trainer (rank 0): health, readiness, Prometheus metrics and a status summary."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

router = APIRouter()


@router.get("/healthz")
async def healthz() -> dict:
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(request: Request) -> Response:
    status = request.app.state.status
    return JSONResponse(status.snapshot(), 200 if status.ready else 503)


@router.get("/v1/status")
async def trainer_status(request: Request) -> dict:
    return request.app.state.status.snapshot()


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    data, content_type = request.app.state.metrics.render()
    return Response(data, media_type=content_type)
