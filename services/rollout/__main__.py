"""``python -m services.rollout --model DIR --port PORT``: serve one rollout pod until SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import os
import signal

PROG = "python -m services.rollout"


def main(argv: list[str] | None = None) -> None:
    import uvloop

    from molt.serve import CPU_ENV, configure_logging, freeze_before_exit, preflight
    from services.rollout.config import parse

    settings = parse(argv)
    from services.rollout.checkpoint import expected_parameters

    server = settings.server
    preflight(
        PROG,
        ports=[("--server.port", server.host, server.port), ("--grpc.port", server.host, settings.grpc.port)],
        models=[("--model.path", settings.model.path)],
    )
    assert settings.model.path  # parse() exits without it
    try:  # fail fast, before vLLM is imported, on a dir that is not a model
        expected_parameters(settings.model.path)
    except (ValueError, OSError) as exc:
        raise SystemExit(f"{PROG}: error: --model.path: {exc}") from None
    from molt.weightsync.auth import server_credentials

    try:  # the PEM files the weight-sync port serves with are readable
        server_credentials(settings.grpc.tls_cert, settings.grpc.tls_key, settings.grpc.tls_client_ca)
    except ValueError as exc:
        raise SystemExit(f"{PROG}: error: {exc}") from None
    # In-process vLLM on CPU: a spinning OpenMP pool starves the asyncio thread.
    os.environ.setdefault("OMP_WAIT_POLICY", CPU_ENV["OMP_WAIT_POLICY"])
    configure_logging(settings.server.log_level)
    from services.rollout.app import build_app

    # uvloop (the one serve runs on) cuts the event loop's share of the GIL the engine thread needs.
    code = uvloop.run(serve_pod(build_app(settings), settings.server))
    logging.getLogger("molt.rollout").info("rollout pod stopped")
    freeze_before_exit()
    if code:
        raise SystemExit(code)


async def serve_pod(app, server, graceful_s: float = 30.0) -> int:
    """Serve until SIGTERM (returns 0) or until the engine dies (returns 1, so that Kubernetes restarts the pod:
    a pod whose engine is gone can never serve again, and only a new process gets a new engine). A dead
    engine stops the server the way SIGTERM does: by the signal, so the same drain and shutdown run."""
    from molt.serve import serve_async

    engine = app.state.engine

    async def stop_when_engine_fails() -> None:
        exc = await engine.wait_failed()
        logging.getLogger("molt.rollout").error("the vLLM engine died (%r): stopping the pod, exit code 1", exc)
        signal.raise_signal(signal.SIGTERM)

    watcher = asyncio.ensure_future(stop_when_engine_fails())
    try:
        await serve_async("rollout", app, server, graceful_s=graceful_s, drain=engine.stop_watching)
    finally:
        watcher.cancel()
    return 1 if engine.failed else 0


if __name__ == "__main__":
    main()
