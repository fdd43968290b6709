"""``build_app(settings)``: the gateway's ASGI app. Nothing happens at import time."""

from __future__ import annotations

import asyncio
import contextlib

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware

from molt.auth import internal_token_from_env
from molt.bus import TrajectoryQueue, open_queue
from molt.bus.redis_stream import RedisTrajectoryQueue
from services.gateway.chat import ChatModel
from services.gateway.config import GatewaySettings
from services.gateway.core import Gateway
from services.gateway.edge import Edge, http_error
from services.gateway.errors import GatewayError
from services.gateway.handoff import SessionHandoff
from services.gateway.limits import RedisOpenSessions
from services.gateway.metrics import gateway_metrics
from services.gateway.pods import PodPool
from services.gateway.replicas import Replicas
from services.gateway.routes import Handlers, routes
from services.gateway.transport import HttpTransport, PodTransport
from services.gateway.wire_routes import WireHandlers, wire_routes


def build_app(
    settings: GatewaySettings,
    *,
    transport: PodTransport | None = None,
    queue: TrajectoryQueue | None = None,
    model: ChatModel | None = None,
) -> Starlette:
    """The app for ``settings``. ``transport`` (pod HTTP) and ``queue`` are injectable for unit tests.

    The returned object is an ASGI app; the core is at ``app.gateway`` for in-process callers.
    """
    if model is None:
        if not settings.model.path:
            raise ValueError("no model: pass --model.path DIR (the tokenizer and chat template come from it)")
        model = ChatModel(settings.model.path)
    if settings.gateway.default_chat_template_kwargs:  # every render's base; a request's own kwargs go over them
        try:
            model = model.with_kwargs(
                settings.gateway.default_chat_template_kwargs, "--gateway.default_chat_template_kwargs"
            )
        except GatewayError as exc:
            raise ValueError(exc.message) from None
    metrics = gateway_metrics()
    rc = settings.rollout
    # Pods guarded by the service token (MOLT_INTERNAL_TOKEN) need it on every generate call.
    client = transport or HttpTransport(
        rc.max_connections, rc.timeout_s, rc.connect_timeout_s, pod_token=internal_token_from_env()
    )
    pool = PodPool(
        rc.urls,
        client,
        metrics,
        rc.health_interval_s,
        rc.stream,
        rc.return_routed_experts,
        model.vocab,
        rc.top_logprobs,
    )
    queue = queue or open_queue(settings.redis, metrics)
    replicas = Replicas(
        settings.replica.public_url, settings.auth.api_keys, client if isinstance(client, HttpTransport) else None
    )
    auth = settings.auth
    limits = None  # the gateway counts in memory: one process
    if auth.api_keys and isinstance(queue, RedisTrajectoryQueue):  # replicas share the trajectory stream's Redis
        limits = RedisOpenSessions(queue.redis, queue.stream, auth.max_open_sessions_per_key, auth.session_lease_s)
    handoff = None  # open sessions are lost when this process exits
    if settings.session.handoff and isinstance(queue, RedisTrajectoryQueue):
        handoff = SessionHandoff(queue.redis, queue.stream, settings.replica.public_url)
    gw = Gateway(settings, model, pool, queue, metrics, replicas.new_session_id, limits, handoff)
    replicas.holds = gw.sessions.__contains__  # adopted sessions are answered here, whatever their id names

    @contextlib.asynccontextmanager
    async def lifespan(app):
        # Pods count as healthy until probed: probe them all once before the server accepts a request, or the
        # first turns could reach a pod that is down or serves another vocabulary.
        await pool.probe_all()
        tasks = [asyncio.create_task(pool.health_loop()), asyncio.create_task(gw.reap_loop())]
        if isinstance(limits, RedisOpenSessions):
            tasks.append(asyncio.create_task(limits.renew_loop(gw.held_by_owner)))
        try:
            yield
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await gw.shut_down()
            pool.close()
            await client.close()
            if handlers.fetcher is not None:
                await handlers.fetcher.close()
            await queue.close()

    handlers = Handlers(gw, replicas)
    edge = Middleware(
        Edge,
        metrics=metrics,
        policy_version=lambda: pool.policy_version,
        replicas=replicas,
        relay=handlers.relay if replicas.public_url else None,
        body_timeout_s=settings.server.body_timeout_s,
    )
    app = Starlette(
        routes=routes(handlers) + wire_routes(WireHandlers(handlers)),
        middleware=[edge],
        exception_handlers={HTTPException: http_error},
        lifespan=lifespan,
    )
    app.gateway = gw  # type: ignore[attr-defined]  # the core, for in-process callers (docstring above)
    return app
