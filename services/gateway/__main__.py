"""``python -m services.gateway --model DIR --rollout.urls URL[,URL...] --redis.url URL --port PORT``."""

from __future__ import annotations

import gc
import logging
import signal
import sys
from types import FrameType

import uvicorn

from molt.config import parse_settings
from molt.net import listening_socket
from services.gateway.app import build_app
from services.gateway.config import GatewaySettings
from services.gateway.core import Gateway
from services.gateway.server import CoalescingHttpToolsProtocol


class DrainingServer(uvicorn.Server):
    """uvicorn's server, except that a first SIGTERM drains (``--session.drain_s``): the open sessions are
    served to their end, or until the drain time is up, before the usual graceful shutdown."""

    def __init__(self, config: uvicorn.Config, gateway: Gateway, drain_s: float) -> None:
        super().__init__(config)
        self.gateway, self.drain_s = gateway, drain_s

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGTERM and self.drain_s > 0 and self.gateway.drain_deadline is None:
            self.gateway.start_draining(self.drain_s)
            return
        super().handle_exit(sig, frame)  # SIGINT, or a second SIGTERM: shut down now

    async def on_tick(self, counter: int) -> bool:
        return self.gateway.drained() or await super().on_tick(counter)


def main(argv: list[str] | None = None) -> None:
    settings = parse_settings(GatewaySettings, argv, prog="python -m services.gateway")
    logging.basicConfig(level=settings.server.log_level.upper(),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    app = build_app(settings)
    # The tokenizer stack imports torch and transformers: millions of long-lived objects that every full
    # garbage collection would walk again (tens of ms, a p99 spike on the request path). Freeze them.
    gc.collect()
    gc.freeze()
    sock = listening_socket("gateway", settings.server.host, settings.server.port)
    DrainingServer(server_config(app, settings), app.gateway, settings.session.drain_s).run(sockets=[sock])


def server_config(app, settings: GatewaySettings) -> uvicorn.Config:
    return uvicorn.Config(app, log_level=settings.server.log_level, access_log=False, loop="uvloop",
                          http=CoalescingHttpToolsProtocol, ws="none", timeout_graceful_shutdown=10,
                          timeout_keep_alive=settings.server.keep_alive_s)


if __name__ == "__main__":
    main()
