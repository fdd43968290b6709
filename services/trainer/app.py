"""``build_app(settings, status, metrics)``: the trainer's small FastAPI app, served by rank 0.

The trainer's work happens in its step loop, not in request handlers; the app only reports on it
(``/healthz``, ``/readyz`` once the model is loaded and resume is done, ``/metrics``, ``/v1/status``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from molt.metrics import Metrics
from services.trainer.config import TrainerSettings
from services.trainer.routes import router


@dataclass
class TrainerStatus:
    ready: bool = False
    step: int = 0
    policy_version: int = 0
    phase: str = "starting"
    trained_trajectories: int = 0
    world_size: int = 1
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def update(self, **kw) -> None:
        with self._lock:
            for k, v in kw.items():
                setattr(self, k, v)

    def snapshot(self) -> dict:
        with self._lock:
            return {
                "ready": self.ready,
                "step": self.step,
                "policy_version": self.policy_version,
                "phase": self.phase,
                "trained_trajectories": self.trained_trajectories,
                "world_size": self.world_size,
            }


def build_app(settings: TrainerSettings, status: TrainerStatus, metrics: Metrics) -> FastAPI:
    app = FastAPI(title="molt trainer")
    app.state.settings = settings
    app.state.status = status
    app.state.metrics = metrics
    app.include_router(router)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc: StarletteHTTPException):  # 404/405 in the services' JSON error shape
        body = {
            "error": {
                "message": str(exc.detail),
                "type": "not_found_error" if exc.status_code == 404 else "invalid_request_error",
                "code": exc.status_code,
            }
        }
        return JSONResponse(body, exc.status_code, headers=exc.headers)

    return app
