"""Shared bearer tokens between Molt's own services, and the service token ``MOLT_INTERNAL_TOKEN``.

Two tokens follow one pattern: the weight-sync token (``MOLT_WEIGHTS_TOKEN``, molt/weightsync/auth.py) and the
service token (``MOLT_INTERNAL_TOKEN``), which guards everything else a caller inside the deployment uses: the
rollout pods' generation API (the gateway sends it) and the env workers' ``POST /v1/episodes:run`` (the
trainer sends it). Both are read from the environment (a Secret in the chart; never a flag, so they stay out
of ``ps`` and ``--dry-run``), travel as ``Authorization: Bearer <token>`` and are compared in constant time.

No token configured: a service serves unauthenticated only on a loopback ``--server.host``; on any other
address it refuses to start unless ``--server.allow_unauthenticated`` says so (``check_internal_exposure``).
The probes (``/healthz``, ``/readyz``) and Prometheus' ``/metrics`` stay open.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
from collections.abc import Iterable, Mapping

from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

INTERNAL_TOKEN_ENV = "MOLT_INTERNAL_TOKEN"
ALLOW_FLAG = "--server.allow_unauthenticated"
OPEN_PATHS = ("/healthz", "/readyz", "/metrics")
"""What a guarded service answers without the token: Kubernetes' probes and Prometheus' scrape."""


def token_from_env(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The token in variable ``name``, or None when it is unset or empty."""
    raw = (os.environ if environ is None else environ).get(name, "").strip()
    return raw or None


def internal_token_from_env(environ: Mapping[str, str] | None = None) -> str | None:
    """The service token, or None when ``MOLT_INTERNAL_TOKEN`` is unset or empty."""
    return token_from_env(INTERNAL_TOKEN_ENV, environ)


def bearer_matches(header: str | bytes | None, token: str) -> bool:
    """Constant-time check of an ``Authorization`` value against ``Bearer <token>``."""
    if header is None:
        return False
    got = header.encode("utf-8", "replace") if isinstance(header, str) else header
    return hmac.compare_digest(got, f"Bearer {token}".encode())


def bearer_headers(token: str | None) -> dict[str, str]:
    """The ``Authorization`` header a client sends with ``token`` (none without one)."""
    return {"Authorization": f"Bearer {token}"} if token else {}


def is_loopback(host: str) -> bool:
    if host in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_exposure(
    token: str | None, host: str, allow_unauthenticated: bool, *, exposed: str, env: str, sender: str, flag: str
) -> None:
    """Refuse (ValueError) to serve ``exposed`` on a non-loopback address without a token: the one-line message
    names the three ways out (set ``env``, bind loopback, or pass ``flag``)."""
    if token is None and not allow_unauthenticated and not is_loopback(host):
        raise ValueError(
            f"{exposed} anyone who reaches {host}: set {env} (the token {sender}), bind --server.host 127.0.0.1, "
            f"or pass {flag}"
        )


def check_internal_exposure(token: str | None, host: str, allow_unauthenticated: bool, exposed: str) -> None:
    """``check_exposure`` for the service token; ``exposed`` says what would be open, e.g. "the pod would
    generate for"."""
    check_exposure(
        token,
        host,
        allow_unauthenticated,
        exposed=exposed,
        env=INTERNAL_TOKEN_ENV,
        sender="its callers send",
        flag=ALLOW_FLAG,
    )


def denial_message(service: str) -> str:
    """What a 401 from a guarded service says: what to send, never the token."""
    return (
        f"missing or wrong service token: send Authorization: Bearer <{INTERNAL_TOKEN_ENV}> (the token {service} "
        "was started with)"
    )


class BearerGuard:
    """Pure ASGI middleware: an HTTP request to any path but ``open_paths`` needs ``Authorization: Bearer
    <token>``, or gets ``denial`` (the service's own 401) before any route runs or any body is read.

    Per request it scans the raw header list of the ASGI scope and compares bytes: the rollout pod's generate
    path is hot, and nothing is built for a request that passes.
    """

    def __init__(self, app: ASGIApp, token: str, denial: Response, open_paths: Iterable[str] = OPEN_PATHS) -> None:
        self.app = app
        self.expected = f"Bearer {token}".encode()
        self.denial = denial
        self.open = frozenset(open_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "lifespan" or scope["path"] in self.open:
            await self.app(scope, receive, send)
            return
        for name, value in scope["headers"]:
            if name == b"authorization":
                if hmac.compare_digest(value, self.expected):
                    await self.app(scope, receive, send)
                    return
                break
        if kind == "http":
            await self.denial(scope, receive, send)
        else:  # a websocket: closed before it is accepted (policy violation)
            await send({"type": "websocket.close", "code": 1008, "reason": ""})
