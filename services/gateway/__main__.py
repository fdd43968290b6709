"""``python -m services.gateway --model DIR --rollout.urls URL[,URL...] --redis.url URL --port PORT``."""

from __future__ import annotations

import asyncio

from molt.config import parse_settings
from molt.serve import configure_logging, preflight, serve
from services.gateway.app import build_app
from services.gateway.config import GatewaySettings, validate_settings

PROG = "python -m services.gateway"


def main(argv: list[str] | None = None) -> None:
    settings = parse_settings(GatewaySettings, argv, prog=PROG, validate=validate_settings)
    preflight(
        PROG,
        ports=[("--server.port", settings.server.host, settings.server.port)],
        models=[("--model.path", settings.model.path)],
        redis_url=settings.redis.url,
        redis_wait_s=settings.redis.startup_wait_s,
    )
    configure_logging(settings.server.log_level)
    app = build_app(settings)
    gateway = app.gateway  # type: ignore[attr-defined]  # set by build_app for in-process callers
    drain_s = settings.session.drain_s

    async def drain() -> None:
        """The first SIGTERM (``--session.drain_s``): the open sessions are served to their end, or until the
        drain time is up, before the usual graceful shutdown."""
        if drain_s <= 0:
            return
        gateway.start_draining(drain_s)
        while not gateway.drained():  # noqa: ASYNC110 - a condition over the open sessions, not one event
            await asyncio.sleep(0.1)

    serve("gateway", app, settings.server, drain=drain)


if __name__ == "__main__":
    main()
