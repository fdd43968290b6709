"""``python -m services.envs --agent NAME=PATH [--agent NAME=PATH ...] --gateway.url URL --server.port PORT``."""

from __future__ import annotations

import logging
import sys

import uvicorn

from molt.config import parse_settings
from molt.net import listening_socket
from services.envs.app import build_app
from services.envs.config import EnvsSettings, normalize_argv


def main(argv: list[str] | None = None) -> None:
    settings = parse_settings(EnvsSettings, normalize_argv(sys.argv[1:] if argv is None else argv),
                              prog="python -m services.envs")
    logging.basicConfig(level=settings.server.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        app = build_app(settings)
    except ValueError as exc:
        sys.exit(f"python -m services.envs: error: {exc}")
    sock = listening_socket("envs", settings.server.host, settings.server.port)
    # uvicorn handles SIGTERM: stop accepting, let running episodes finish (up to their timeout), exit.
    config = uvicorn.Config(app, log_level=settings.server.log_level, access_log=False,
                            timeout_keep_alive=settings.server.keep_alive_s,
                            timeout_graceful_shutdown=int(settings.envs.episode_timeout_s) + 5)
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    main()
