"""Loopback/port helpers every service and the local stack share, and NDJSON line framing."""

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


class LineSplitter:
    """Complete lines out of a byte stream that arrives in arbitrary pieces (NDJSON over chunked HTTP: the
    gateway's and the pod's ends of the generate stream). The unterminated tail is kept as pieces and joined
    once its newline arrives, so a long line that trickles in is copied once, not once per piece."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []
        self.pending_bytes = 0
        """Bytes of the unterminated tail (a caller caps it to refuse a line that never ends)."""

    def feed(self, data: bytes) -> list[bytes]:
        """The lines ``data`` completes, blank ones dropped, without their newlines."""
        end = data.rfind(b"\n")
        if end < 0:
            if data:
                self._parts.append(data)
                self.pending_bytes += len(data)
            return []
        head = b"".join(self._parts) + data[:end] if self._parts else data[:end]
        tail = data[end + 1 :]
        self._parts, self.pending_bytes = ([tail] if tail else []), len(tail)
        return [line for line in head.split(b"\n") if line.strip()]

    def rest(self) -> bytes:
        """The unterminated tail (the last line of a stream that ended without a newline)."""
        return b"".join(self._parts)
