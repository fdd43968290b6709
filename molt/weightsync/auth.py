"""The weight-sync credential: one shared bearer token, read from ``MOLT_WEIGHTS_TOKEN``.

Only the trainer may change a pod's weights. Pods, the trainer and ``services.trainer.push`` read the
same token from the environment (a Secret in the chart; never a flag, so it stays out of ``ps`` and
``--dry-run``) and every weight-changing call carries it: gRPC metadata ``authorization: Bearer T`` on
all WeightSync RPCs (the collective path's control included), the HTTP ``Authorization`` header on the
pod's ``POST /v1/weights/reload``. Comparison is constant-time. The generic parts (the header check, the
loopback rule) are molt/auth.py's, shared with the service token ``MOLT_INTERNAL_TOKEN``.

No token configured: a pod accepts unauthenticated weight changes only while it listens on a loopback
address; on any other address it refuses to start unless ``--weights.allow_unauthenticated`` says so.

Optional (mutual) TLS for the gRPC port, on top of the token (which then no longer travels in clear; the
HTTP reload stays token-only): the pod serves with
``--grpc.tls_cert/--grpc.tls_key`` and, with ``--grpc.tls_client_ca``, accepts only clients whose
certificate that CA signed; the trainer side reads ``MOLT_WEIGHTS_TLS_CA`` (to verify pods) and
``MOLT_WEIGHTS_TLS_CERT``/``MOLT_WEIGHTS_TLS_KEY`` (its client certificate).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import grpc

from molt import auth
from molt.auth import bearer_matches as bearer_matches  # the generic parts, kept importable from here
from molt.auth import is_loopback as is_loopback

TOKEN_ENV = "MOLT_WEIGHTS_TOKEN"
TLS_ENV = ("MOLT_WEIGHTS_TLS_CA", "MOLT_WEIGHTS_TLS_CERT", "MOLT_WEIGHTS_TLS_KEY")


def token_from_env(environ: Mapping[str, str] | None = None) -> str | None:
    """The configured token, or None when ``MOLT_WEIGHTS_TOKEN`` is unset or empty."""
    return auth.token_from_env(TOKEN_ENV, environ)


def check_exposure(token: str | None, host: str, allow_unauthenticated: bool) -> None:
    """Refuse (ValueError) to serve weight changes on a non-loopback address without a token."""
    auth.check_exposure(
        token,
        host,
        allow_unauthenticated,
        exposed="the pod would accept weight changes from",
        env=TOKEN_ENV,
        sender="the trainer sends",
        flag="--weights.allow_unauthenticated",
    )


def _read(path: str | None, what: str) -> bytes | None:
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ValueError(f"{what}: cannot read {path}: {exc}") from None


def server_credentials(cert: str | None, key: str | None, client_ca: str | None) -> grpc.ServerCredentials | None:
    """TLS for the pod's gRPC port (None without a certificate); a client CA makes it mutual TLS."""
    if not cert and not key and not client_ca:
        return None
    if not cert or not key:
        raise ValueError("gRPC TLS needs both --grpc.tls_cert and --grpc.tls_key (PEM files)")
    ca = _read(client_ca, "--grpc.tls_client_ca")
    return grpc.ssl_server_credentials(
        [(_read(key, "--grpc.tls_key"), _read(cert, "--grpc.tls_cert"))],
        root_certificates=ca,
        require_client_auth=ca is not None,
    )


def channel_credentials_from_env(environ: Mapping[str, str] | None = None) -> grpc.ChannelCredentials | None:
    """The trainer side's TLS from MOLT_WEIGHTS_TLS_CA / _CERT / _KEY; None (plaintext) when none is set."""
    env = os.environ if environ is None else environ
    ca, cert, key = (env.get(name) or None for name in TLS_ENV)
    if not (ca or cert or key):
        return None
    if bool(cert) != bool(key):
        raise ValueError("MOLT_WEIGHTS_TLS_CERT and MOLT_WEIGHTS_TLS_KEY go together (the client certificate)")
    return grpc.ssl_channel_credentials(
        root_certificates=_read(ca, "MOLT_WEIGHTS_TLS_CA"),
        private_key=_read(key, "MOLT_WEIGHTS_TLS_KEY"),
        certificate_chain=_read(cert, "MOLT_WEIGHTS_TLS_CERT"),
    )


class BearerInterceptor(grpc.aio.ServerInterceptor):
    """Answers UNAUTHENTICATED, before any handler runs, to a call without the right bearer token."""

    def __init__(self, token: str) -> None:
        self.token = token

        async def deny_unary(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"missing or wrong weight-sync token ({TOKEN_ENV})")

        async def deny_stream(request_iterator, context):
            await deny_unary(None, context)

        self._deny = {
            False: grpc.unary_unary_rpc_method_handler(deny_unary),
            True: grpc.stream_unary_rpc_method_handler(deny_stream),
        }

    async def intercept_service(self, continuation, handler_call_details):
        metadata = handler_call_details.invocation_metadata or ()
        header = next((v for k, v in metadata if k == "authorization"), None)
        if bearer_matches(header, self.token):
            return await continuation(handler_call_details)
        return self._deny[handler_call_details.method.endswith("/Push")]
