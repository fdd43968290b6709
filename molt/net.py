"""Loopback/port helpers every service and the local stack share."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port the kernel reports free on ``host`` now (another process may still take it before use)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def listening_socket(service: str, host: str, port: int, backlog: int = 2048) -> socket.socket:
    """Bind and listen on ``host:port`` (0: the kernel picks), then print the one line a supervisor or a test
    parses for the chosen port: ``molt-<service> listening on http://HOST:PORT``. Listening comes first, so a
    client that connects as soon as it reads the line is queued, not refused."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(backlog)
    bound_host, bound_port = sock.getsockname()[:2]
    print(f"molt-{service} listening on http://{bound_host}:{bound_port}", flush=True)
    return sock
