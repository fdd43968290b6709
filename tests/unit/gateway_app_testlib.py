"""Shared by the in-process gateway app tests (wires, sessions): two fake pods, a scripted reply queue, and the
calls that open a session, read what the gateway wrote, and list what the pods were sent."""

from __future__ import annotations

from collections.abc import Callable

import httpx

from services.gateway.chat import ChatModel
from tests.gateway_testlib import FakePods, scripted_gateway

PODS = ["http://pod-a:1", "http://pod-b:2"]
CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": CITY}}
]


class Replies:
    """Pod script: each call answers the next queued text (then a default)."""

    def __init__(self, model: ChatModel) -> None:
        self.model = model
        self.queue: list[str] = []

    def __call__(self, prompt: list[int], sp: dict) -> list[int]:
        text = self.queue.pop(0) if self.queue else "Hello world.<|im_end|>"
        return self.model.encode(text)


def scripted_env(model: ChatModel) -> Callable[..., tuple]:
    """make(**settings overrides) -> (app, pods, replies, http): a gateway on PODS answering from ``replies``."""

    def make(**overrides):
        replies = Replies(model)
        app, pods, http = scripted_gateway(model, replies, PODS, **overrides)
        return app, pods, replies, http

    return make


async def open_session(http: httpx.AsyncClient, headers=None, **body) -> dict:
    r = await http.post("/v1/sessions", json=body, headers=headers)
    assert r.status_code == 201, r.text
    return r.json()


async def written(app) -> list:
    q = app.gateway.queue
    return [d.trajectory for d in await q.read("t", 100, block_s=0)]


def pod_calls(pods: FakePods) -> list[tuple[list[int], dict]]:
    return [c for p in pods.pods.values() for c in p.calls]
