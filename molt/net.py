"""Loopback/port helpers every service and the local stack share, and NDJSON line framing."""

from __future__ import annotations

import itertools
import random
import socket
from pathlib import Path

_LOWEST_PICKED_PORT = 20000
_handed_out: set[int] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now (another process may still take it before use), below the kernel's ephemeral
    range where that range can be read. The kernel's own pick (bind to port 0) comes from that range, which is
    also where every outgoing connection gets its source port: a service restarted on its port (a supervisor, a
    fault test) could find it taken by some client's connection meanwhile. Never the same port twice in one
    process: callers pick several ports before any service binds one."""
    low = _ephemeral_port_low()
    tries = 64 if low - _LOWEST_PICKED_PORT >= 1000 else 0
    below = (random.randrange(_LOWEST_PICKED_PORT, low) for _ in range(tries))
    for wanted in itertools.chain(below, [0] * 64):  # then the kernel's picks
        port = _bindable(host, wanted)
        if port and port not in _handed_out:
            _handed_out.add(port)
            return port
    raise OSError(f"no free port on {host}")


def _bindable(host: str, port: int) -> int:
    """``port`` (0: the kernel's pick) if it can be bound on ``host`` now, else 0."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        try:
            s.bind((host, port))
        except OSError:
            return 0
        return s.getsockname()[1]


def _ephemeral_port_low() -> int:
    """The lowest port of the kernel's ephemeral range (Linux), or 0 where it cannot be read."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def host_port(host: str, port: int) -> str:
    """``host:port`` as URLs and gRPC targets spell it: an IPv6 literal in brackets (``[::]:50051``), since
    its own colons would otherwise run into the port's."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def listening_socket(service: str, host: str, port: int, backlog: int = 2048) -> socket.socket:
    """Bind and listen on ``host:port`` (0: the kernel picks), then print the one line a supervisor or a test
    parses for the chosen port: ``molt-<service> listening on http://HOST:PORT``. Listening comes first, so a
    client that connects as soon as it reads the line is queued, not refused."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(backlog)
    bound_host, bound_port = sock.getsockname()[:2]
    print(f"molt-{service} listening on http://{host_port(bound_host, bound_port)}", flush=True)
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
