"""The trainer's HTTP surface (read-only): any method, path or body gets a JSON answer, never a 5xx."""

from __future__ import annotations

import asyncio
import json

import httpx
from http_fuzz import FUZZ, encode, json_values
from hypothesis import given
from hypothesis import strategies as st

from services.trainer.app import TrainerStatus, build_app
from services.trainer.config import TrainerSettings
from services.trainer.metrics import trainer_metrics


@FUZZ
@given(
    method=st.sampled_from(["GET", "POST", "PUT", "DELETE"]),
    path=st.sampled_from(["/healthz", "/readyz", "/v1/status", "/metrics", "/v1/nothing", "/v1/status/x"]),
    body=json_values,
)
def test_every_route_answers_without_a_5xx_and_errors_in_the_json_shape(method, path, body):
    app = build_app(TrainerSettings(), TrainerStatus(ready=True), trainer_metrics())

    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://trainer") as client:
            return await client.request(method, path, content=encode(body))

    r = asyncio.run(go())
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        err = json.loads(r.content)["error"]
        assert err["code"] == r.status_code and err["message"]
        assert r.status_code in (404, 405)
