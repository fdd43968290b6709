"""Thin HTTP handlers: auth, body parsing, then one call into the core and one encoder.

Here: the session API (open, generate, render, renew, abort, finish, episodes), the ops endpoints (health,
readiness, metrics, models) and the request helpers; the OpenAI and Anthropic wires are in wire_routes.py."""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import Callable
from typing import Any

import msgspec
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from services.gateway import openai_wire as oa
from services.gateway.chat import bad_request
from services.gateway.core import Gateway
from services.gateway.errors import GatewayError
from services.gateway.finish import queue_reachable, refresh_queue_metrics
from services.gateway.image_fetch import ImageFetcher
from services.gateway.replicas import FORWARDED, Replicas, session_of
from services.gateway.transport import json_loads


class _JSON(JSONResponse):
    """Starlette's JSONResponse (same bytes, NaN still refused) with its encoder built once, not per response."""

    encoder = json.JSONEncoder(ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":"))

    def render(self, content: Any) -> bytes:
        return self.encoder.encode(content).encode("utf-8")


class TurnJSON(Response):
    """A turn's answer, on the hot path: msgspec encodes it, ~8x faster than json (its only floats are the pod's
    logprobs, refused where they are parsed unless finite, so json's NaN check has nothing left to catch), and its
    three headers are built here instead of by Starlette's generic header set-up."""

    encoder = msgspec.json.Encoder()

    def __init__(self, content: Any, version: int) -> None:
        self.status_code = 200
        self.background = None
        self.body = self.encoder.encode(content)
        self.raw_headers = [
            (b"content-type", b"application/json"),
            (b"content-length", b"%d" % len(self.body)),
            (b"x-molt-policy-version", b"%d" % version),
        ]


def _lone_surrogate(value: Any, where: str = "body") -> str | None:
    """Where in a parsed body a string holds a lone surrogate (a valid pair decodes to one character), or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return where
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found = _lone_surrogate(key, where) if isinstance(key, str) else None
        found = found or _lone_surrogate(item, f"{where}.{key}" if isinstance(key, str) else f"{where}[{key}]")
        if found is not None:
            return found
    return None


class Handlers:
    def __init__(self, gw: Gateway, replicas: Replicas | None = None) -> None:
        self.gw = gw
        self.replicas = replicas or Replicas("", [])
        self.keys = [k.encode() for k in gw.settings.auth.api_keys]
        self.max_body = gw.settings.session.max_body_bytes
        self.model_name = gw.settings.served_model_name
        self.fetcher = ImageFetcher(gw.settings.gateway) if gw.settings.gateway.fetch_images else None

    # ---- helpers

    def owner(self, request: Request) -> str | None:
        if not self.keys:
            return None
        auth = request.headers.get("authorization", "")
        key = auth[7:].strip() if auth[:7].lower() == "bearer " else request.headers.get("x-api-key", "")
        raw = key.encode()
        for k in self.keys:
            if hmac.compare_digest(raw, k):
                return key
        raise GatewayError(
            401,
            "missing or invalid API key: send 'Authorization: Bearer KEY' (or 'x-api-key')",
            code="invalid_api_key",
        )

    async def raw_body(self, request: Request) -> bytes:
        """The whole body, refused (413) as soon as it is known to pass ``--session.max_body_bytes``: from its
        Content-Length, or while a chunked body arrives, so an oversized upload is never held whole. Read from
        ``receive`` directly: Starlette's ``Request.body`` goes through an async generator per request."""
        length = request.headers.get("content-length")
        if length and length.isdigit() and int(length) > self.max_body:
            raise GatewayError(
                413, f"request body of {length} bytes is over the {self.max_body}-byte limit", code="request_too_large"
            )
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await request.receive()
            if message["type"] != "http.request":
                raise ClientDisconnect()
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                raise GatewayError(
                    413, f"request body is over the {self.max_body}-byte limit", code="request_too_large"
                )
            chunks.append(chunk)
            if not message.get("more_body", False):
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    async def body(self, request: Request) -> dict:
        raw = await self.raw_body(request)
        try:
            data = json_loads(raw) if raw else {}
        except (ValueError, RecursionError) as exc:  # RecursionError: nested past Python's stack
            raise bad_request(f"the body is not valid JSON ({str(exc)[:200]})") from None
        if not isinstance(data, dict):
            raise bad_request("the body must be a JSON object")
        if b"\\ud" in raw or b"\\uD" in raw:  # a \uD800-\uDFFF escape: a lone one cannot be tokenized or encoded
            where = _lone_surrogate(data)
            if where is not None:
                raise bad_request(
                    f"{where} holds a lone UTF-16 surrogate (\\ud800-\\udfff without its pair): not "
                    "text; send valid Unicode",
                    where,
                )
        if self.fetcher is not None:
            await self.fetcher.inline(data)
        return data

    def json(self, data: Any, version: int | None = None, status: int = 200) -> JSONResponse:
        headers = {"x-molt-policy-version": str(version)} if version is not None else None
        return _JSON(data, status_code=status, headers=headers)

    async def relay(self, replica: str, scope, receive, send) -> bytes | None:
        """A request for a session ``replica`` holds: checked here like any other (key, body size), then
        forwarded there and its answer relayed back (services/gateway/replicas.py); None once answered.

        When ``replica`` does not answer at all, it may have exited and parked the session
        (services/gateway/handoff.py): this replica then adopts it and returns the request's body, to be
        answered here, or relays to the replica that adopted it first. ``replica`` ``""``: the session is this
        replica's own but not held here (see ``Replicas.target``): looked up the same way first."""
        request = Request(scope, receive, send)
        owner = self.owner(request)
        body = await self.raw_body(request)
        sid = session_of(scope["path"])
        failed: GatewayError | None = None
        for _ in range(3):  # the owner, then at most two replicas that adopted the session in turn
            if replica:
                try:
                    await self.replicas.forward(replica, scope, body, send)
                    return None
                except GatewayError as exc:
                    if exc.code != "replica_unreachable" or scope["state"].get("relay_answered") or sid is None:
                        raise
                    failed = exc
            where = await self.gw.locate(sid, owner) if sid is not None else None
            if where in ("", self.replicas.public_url) or (where is None and failed is None):
                scope["state"].pop("relayed", None)  # held here now, or nowhere else: answered here (404)
                return body
            if where is None or where == replica:
                assert failed is not None
                raise failed
            self.replicas.remember_move(sid, where)  # type: ignore[arg-type]  # sid is set whenever where is
            replica = where
        assert failed is not None
        raise failed

    # ---- control plane

    async def healthz(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(self, request: Request) -> Response:
        # Counts, not URLs: this port faces agents, and pod addresses are the internal network's map (the
        # per-pod state is in /metrics and the gateway's log).
        pods = self.gw.pool.pods.values()
        healthy = sum(p.healthy for p in pods)
        redis = await queue_reachable(self.gw.queue)
        ready = healthy > 0 and self.gw.drain_deadline is None and redis
        body = {
            "ready": ready,
            "healthy_pods": healthy,
            "pods": len(pods),
            "draining": self.gw.drain_deadline is not None,
        }
        return JSONResponse(
            {**body, "redis": redis},
            status_code=200 if ready else 503,
        )

    async def metrics(self, request: Request) -> Response:
        await refresh_queue_metrics(self.gw.queue, self.gw.metrics)
        body, ctype = self.gw.metrics.render()
        return Response(body, media_type=ctype)

    async def models(self, request: Request) -> Response:
        self.owner(request)
        return self.json(oa.models_response(self.model_name))

    async def model(self, request: Request) -> Response:
        """OpenAI's retrieve-a-model: the served model by its name; any other name is a 404 in OpenAI's shape."""
        self.owner(request)
        name = request.path_params["model"]
        if name != self.model_name:
            raise GatewayError(404, f"The model '{name[:80]}' does not exist", code="model_not_found", param="model")
        return self.json(oa.models_response(self.model_name)["data"][0])

    async def open_session(self, request: Request) -> Response:
        owner = self.owner(request)
        s = await self.gw.open_session(owner, await self.body(request))
        base = str(request.base_url).rstrip("/")  # as the client reached us; replicas.py routes the id from there
        return self.json(
            {
                "session_id": s.id,
                "trajectory_id": s.id,
                "openai_base_url": f"{base}/s/{s.id}/v1",
                "anthropic_base_url": f"{base}/s/{s.id}",
                "max_length": s.capture.max_length,
            },
            status=201,
        )

    async def get_session(self, request: Request) -> Response:
        s = await self.gw.session(request.path_params["sid"], self.owner(request), open_only=False)
        return self.json(s.summary())

    async def renew_session(self, request: Request) -> Response:
        return self.json(await self.gw.renew(request.path_params["sid"], self.owner(request)))

    async def delete_session(self, request: Request) -> Response:
        return self.json(await self.gw.abort(request.path_params["sid"], self.owner(request)))

    async def finish(self, request: Request) -> Response:
        owner = self.owner(request)
        res = await self.gw.finish(request.path_params["sid"], owner, await self.body(request))
        res.pop("status", None)
        return self.json(res)

    async def episodes(self, request: Request) -> Response:
        owner = self.owner(request)
        items = (await self.body(request)).get("episodes")
        if not isinstance(items, list) or not items:
            raise bad_request("'episodes' must be a non-empty list of {session_id, reward, score?, info?}", "episodes")
        results = await self._finish_everywhere(items, owner, request)
        unavailable = [r for r in results if r.get("status") == 503]
        if unavailable:  # the whole call again: what was written meanwhile is answered the same way (idempotent)
            err = unavailable[0]["error"]
            raise GatewayError(
                503,
                f"{len(unavailable)} of {len(results)} episodes could not be finished now "
                f"({err['message']}); send the call again",
                code=err["code"],
                retry_after_s=1,
            )
        return self.json({"results": results, "written": sum(1 for r in results if r.get("written"))})

    async def _finish_everywhere(self, items: list, owner: str | None, request: Request) -> list[dict]:
        """finish_many here for this replica's sessions; one forwarded call per other replica for theirs. The
        items of a replica that does not answer are located again (it may have exited and parked them,
        services/gateway/handoff.py): finished here once adopted, or sent on to the replica that adopted them."""
        results: list[dict] = [{}] * len(items)
        forwarded = bool(request.headers.get(FORWARDED))

        def sid_of(i: int) -> str | None:
            sid = items[i].get("session_id") if isinstance(items[i], dict) else None
            return sid if isinstance(sid, str) else None

        def group(idx: list[int], replica_of: Callable[[int], str | None]) -> dict[str | None, list[int]]:
            by_replica: dict[str | None, list[int]] = {}
            for i in idx:
                by_replica.setdefault(None if forwarded else replica_of(i), []).append(i)
            return by_replica

        def failed(i: int, exc: GatewayError) -> dict:
            return {"session_id": sid_of(i), "status": exc.status, "error": {"message": exc.message, "code": exc.code}}

        async def finish(replica: str | None, idx: list[int], last_try: bool) -> None:
            try:
                if replica is None:
                    out = await self.gw.finish_many([items[i] for i in idx], owner)
                else:
                    try:
                        out = (
                            await self.replicas.post_json(
                                replica,
                                "/v1/episodes",
                                {"episodes": [items[i] for i in idx]},
                                request.scope["headers"],
                            )
                        )["results"]
                    except GatewayError as exc:
                        if exc.code != "replica_unreachable" or last_try:
                            raise
                        places = {i: await self.gw.locate(sid_of(i) or "", owner) for i in idx}
                        moved = {i: p for i, p in places.items() if p is not None and p != replica}
                        for i in idx:
                            if i not in moved:  # not parked, not adopted: the replica's failure is their answer
                                results[i] = failed(i, exc)
                        await asyncio.gather(
                            *(
                                finish(r or None, sub, True)  # "": adopted here
                                for r, sub in group(list(moved), moved.__getitem__).items()
                            )
                        )
                        return
            except GatewayError as exc:
                out = [failed(i, exc) for i in idx]
            for i, res in zip(idx, out):
                results[i] = res

        await asyncio.gather(
            *(
                finish(r, idx, False)
                for r, idx in group(list(range(len(items))), lambda i: self.replicas.where(sid_of(i))).items()
            )
        )
        return results

    async def generate(self, request: Request) -> Response:
        owner = self.owner(request)
        body = await self.body(request)
        s = await self.gw.session(request.path_params["sid"], owner)
        r = await self.gw.token_turn(s, body)
        request.scope["state"]["pod_wait_s"] = r.pod_wait_s
        out = {
            "token_ids": r.token_ids,
            "logprobs": r.logprobs,
            "text": r.raw_text,
            "finish_reason": r.finish_reason,
            "policy_version": r.policy_version,
            "num_tokens": r.num_tokens,
            "remaining_tokens": r.remaining_tokens,
        }
        if r.prompt_tokens_dropped:
            out.update(prompt_text=r.prompt_text, prompt_tokens_dropped=r.prompt_tokens_dropped)
        return TurnJSON(out, r.policy_version)

    async def render(self, request: Request) -> Response:
        owner = self.owner(request)
        body = await self.body(request)
        s = await self.gw.session(request.path_params["sid"], owner)
        return self.json(self.gw.render_prompt(s, body))


def routes(h: Handlers) -> list[Route]:
    return [
        Route("/v1/sessions/{sid}/generate", h.generate, methods=["POST"]),
        Route("/v1/sessions/{sid}/render", h.render, methods=["POST"]),
        Route("/v1/sessions", h.open_session, methods=["POST"]),
        Route("/v1/sessions/{sid}/finish", h.finish, methods=["POST"]),
        Route("/v1/sessions/{sid}/renew", h.renew_session, methods=["POST"]),
        Route("/v1/episodes", h.episodes, methods=["POST"]),
        Route("/v1/sessions/{sid}", h.get_session, methods=["GET"]),
        Route("/v1/sessions/{sid}", h.delete_session, methods=["DELETE"]),
        Route("/v1/models", h.models, methods=["GET"]),
        Route("/s/{sid}/v1/models", h.models, methods=["GET"]),
        Route("/v1/models/{model:path}", h.model, methods=["GET"]),
        Route("/s/{sid}/v1/models/{model:path}", h.model, methods=["GET"]),
        Route("/healthz", h.healthz, methods=["GET"]),
        Route("/readyz", h.readyz, methods=["GET"]),
        Route("/metrics", h.metrics, methods=["GET"]),
    ]
