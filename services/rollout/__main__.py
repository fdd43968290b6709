"""``python -m services.rollout --model DIR --port PORT``: serve one rollout pod until SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal


def main(argv: list[str] | None = None) -> None:
    from services.rollout.config import parse

    settings = parse(argv)
    from services.rollout.checkpoint import expected_parameters

    try:  # fail fast, before vLLM is imported, on a dir that is not a model
        expected_parameters(settings.model.path)
    except (ValueError, OSError) as exc:
        raise SystemExit(f"python -m services.rollout: error: --model.path: {exc}") from None
    # In-process vLLM on CPU: a spinning OpenMP pool starves the asyncio thread (cpu-stack.md §3).
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    logging.basicConfig(level=settings.server.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:  # uvloop (uvicorn[standard]) cuts the event loop's share of the GIL the engine thread needs
        import uvloop
    except ImportError:
        asyncio.run(serve(settings))
    else:
        uvloop.run(serve(settings))


async def serve(settings) -> None:
    import uvicorn

    from services.rollout.app import build_app

    class Server(uvicorn.Server):
        """SIGTERM/SIGINT drain and exit 0 (uvicorn would re-raise the signal after its graceful shutdown)."""

        @contextlib.contextmanager
        def capture_signals(self):
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, self.handle_exit, sig, None)
            try:
                yield
            finally:
                for sig in (signal.SIGINT, signal.SIGTERM):
                    loop.remove_signal_handler(sig)

    config = uvicorn.Config(build_app(settings), host=settings.server.host, port=settings.server.port,
                            log_level=settings.server.log_level, access_log=False,
                            timeout_keep_alive=settings.server.keep_alive_s)
    server = Server(config)

    async def announce() -> None:
        while not server.started:
            if server.should_exit:
                return
            await asyncio.sleep(0.05)
        port = server.servers[0].sockets[0].getsockname()[1]
        # One parseable line: launchers and tests wait for it.
        print(f"ROLLOUT_READY http://{settings.server.host}:{port}", flush=True)

    watcher = asyncio.create_task(announce())
    await server.serve()
    watcher.cancel()
    logging.getLogger("molt.rollout").info("rollout pod stopped")


if __name__ == "__main__":
    main()
