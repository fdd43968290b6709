"""``python -m services.envs --agent NAME=PATH [--agent NAME=PATH ...] --gateway.url URL --server.port PORT``."""

from __future__ import annotations

import logging
import os
import sys

from molt.auth import INTERNAL_TOKEN_ENV
from molt.config import parse_settings
from molt.serve import configure_logging, preflight, serve
from services.envs.app import build_app
from services.envs.config import EnvsSettings, normalize_argv, validate_settings

PROG = "python -m services.envs"


def main(argv: list[str] | None = None) -> None:
    settings = parse_settings(
        EnvsSettings, normalize_argv(sys.argv[1:] if argv is None else argv), prog=PROG, validate=validate_settings
    )
    # Agents run in this process and may start children that inherit its environment (Molt's python_executor
    # tool runs model-written code in a plain python3): the key reaches the gateway client and ctx.api_key only.
    os.environ.pop("MOLT_GATEWAY__API_KEY", None)
    preflight(PROG, ports=[("--server.port", settings.server.host, settings.server.port)])
    configure_logging(settings.server.log_level)
    configure_sandbox(settings.sandbox.isolation)
    try:
        app = build_app(settings)
    except ValueError as exc:  # an agent module that does not load: a config error, as the flags' are
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        sys.exit(2)
    # The app holds the service token now; agents' children (a tool running model-written code in a plain
    # python3) inherit this process's environment and must not be able to submit episodes with it.
    os.environ.pop(INTERNAL_TOKEN_ENV, None)
    seal_environment()
    report_sandbox(settings.sandbox.isolation)  # after the agents loaded: a start-up error stays one line
    # SIGTERM: stop accepting, let running episodes finish (up to their timeout), exit.
    serve("envs", app, settings.server, graceful_s=settings.envs.episode_timeout_s + 5)


PR_SET_DUMPABLE = 4


def seal_environment() -> None:
    """Popped keys stay in /proc/PID/environ (the environment the process started with), readable by any process
    of the same uid, such as a tool's plain python3 child. A process that is not dumpable has its /proc files
    owned by root: the keys stay out of reach (and so do ptrace, core dumps and a same-uid py-spy)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        logging.getLogger("molt.envs").warning(
            "prctl(PR_SET_DUMPABLE, 0) failed (%s): the start-up environment stays readable in /proc by this uid",
            os.strerror(ctypes.get_errno()),
        )


def configure_sandbox(isolation: str) -> None:
    """Export --sandbox.isolation to the agents' tool calls, before the agents load (one may read it at import)."""
    # Agents call molt.agents.sandbox.run_python without config: the resolved flag reaches them through the env.
    os.environ["MOLT_SANDBOX__ISOLATION"] = isolation


def report_sandbox(isolation: str) -> None:
    """Log what the agents' tool calls will get under --sandbox.isolation."""
    log = logging.getLogger("molt.envs")
    if isolation == "none":
        log.warning("--sandbox.isolation none: tool code runs WITHOUT OS isolation (trusted code only)")
        return
    from molt.agents.sandbox import bwrap_status

    ok, why, with_proc = bwrap_status()
    if ok:
        log.info(
            "tool sandbox: bubblewrap (no network, own PID namespace, read-only fs, uid 65534%s)",
            "" if with_proc else ", no /proc: this container forbids mounting one",
        )
    else:
        log.error("tool sandbox unavailable (%s): tool calls will be refused; see --sandbox.isolation", why)


if __name__ == "__main__":
    main()
