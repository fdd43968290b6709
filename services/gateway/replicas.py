"""Several gateway replicas behind one Service: a session lives on the replica that opened it.

A session's token trace is in the memory of the replica that opened it, so every later request for it
must reach that replica. With ``--replica.public_url`` set (the chart sets each pod's own address):
- the session's id names the replica: ``<uuid>.<base32 of the replica's URL>.<signature>``. The
  signature is an HMAC under the API keys every replica shares, so a replica only ever follows ids a
  replica issued (a forged id is answered where it lands, with a 404, never fetched from an address a
  client chose);
- a request for it that reaches another replica (``/s/{id}/...``, ``/v1/sessions/{id}...``) is
  forwarded there once and the answer, streams included, relayed back; ``POST /v1/episodes`` sends each
  replica its own items in one call.
The session's URLs keep the host the client used (the Service, an ingress): every client can reach
them, and the id does the routing. The chart also gives the Service ClientIP affinity, so an in-cluster
client's requests land on the replica that opened its sessions and are rarely forwarded.

Without ``public_url`` ids are plain uuids and nothing is forwarded (one replica).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import hmac
import json
import time
import uuid
from collections.abc import Callable
from typing import Any

from services.gateway.errors import GatewayError
from services.gateway.transport import HttpTransport, PodConnectionError

FORWARDED = "x-molt-forwarded-by"
"""Set on forwarded requests: the owner answers them itself, so a request is forwarded at most once."""
_FORWARDED = FORWARDED.encode()
# Hop-by-hop headers (RFC 9110 7.6.1), the ones the relay or the server here set themselves, and Expect (the
# body is sent whole; a "100 Continue" from the owner would read as its answer).
_SKIP = {
    b"host",
    b"connection",
    b"keep-alive",
    b"transfer-encoding",
    b"te",
    b"trailer",
    b"upgrade",
    b"proxy-connection",
    b"content-length",
    b"server-timing",
    b"date",
    b"server",
    b"expect",
    _FORWARDED,
}
_SKIP_ANSWER = _SKIP - {b"content-length"}  # the relayed body is byte for byte the owner's


def session_of(path: str) -> str | None:
    """The session id a request path names (``/s/{id}/...``, ``/v1/sessions/{id}[/...]``), else None."""
    for prefix in ("/s/", "/v1/sessions/"):
        if path.startswith(prefix):
            return path[len(prefix) :].split("/", 1)[0] or None
    return None


def _duration(server_timing: str, name: str) -> float | None:
    """``dur`` of metric ``name`` in a Server-Timing header value (ms), or None."""
    for part in server_timing.split(","):
        metric, _, params = part.strip().partition(";")
        if metric == name and params.startswith("dur="):
            try:
                return float(params[4:])
            except ValueError:
                return None
    return None


def _b32(text: str) -> str:
    return base64.b32encode(text.encode()).decode().rstrip("=").lower()


class Replicas:
    """Session ids, owners and the relay of one replica; ``Replicas("", [])`` is the single-replica case.
    Peers are reached with the gateway's own keep-alive HTTP client (``HttpTransport.relay``)."""

    def __init__(self, public_url: str, api_keys: list[str], transport: HttpTransport | None = None) -> None:
        self.public_url = public_url
        self.transport = transport  # the gateway's keep-alive HTTP client (one pool per peer, as per pod)
        self._key = hashlib.sha256("\n".join(sorted(api_keys)).encode()).digest()
        self._tag = self._sign(_b32(public_url)) if public_url else ""
        self.holds: Callable[[str], bool] = lambda sid: False
        """Whether this replica holds a session (set by the app): one adopted from a replica that exited is
        answered here, whatever its id names (services/gateway/handoff.py)."""
        self.moved: dict[str, str] = {}
        """Session id -> the replica that adopted it, for sessions whose id names a replica that is gone."""

    def _sign(self, encoded_url: str) -> str:
        return f"{encoded_url}.{hmac.new(self._key, encoded_url.encode(), 'sha256').hexdigest()[:16]}"

    def new_session_id(self) -> str:
        sid = uuid.uuid4().hex
        return f"{sid}.{self._tag}" if self._tag else sid

    def owner(self, sid: str | None) -> str | None:
        """URL of the replica holding ``sid`` when that is another replica; None when it is this one, or the id
        names no replica, or its signature does not check out (this replica then answers it itself)."""
        if not self._tag or not sid or sid.count(".") != 2:
            return None
        encoded, _, sig = sid.partition(".")[2].partition(".")
        # Bytes: compare_digest refuses text with non-ASCII characters, which a client may put in the path.
        signed = f"{encoded}.{sig}"
        if signed == self._tag or not hmac.compare_digest(self._sign(encoded).encode(), signed.encode()):
            return None
        try:
            return base64.b32decode(encoded.upper() + "=" * (-len(encoded) % 8)).decode()
        except (binascii.Error, ValueError):
            return None

    def target(self, scope) -> str | None:
        """The replica to relay this request to: it names a session another replica holds (``owner``, or the
        replica that adopted it when that one exited), it was not relayed here already (so a request travels
        at most once), and it is not a HEAD (whose answer announces a Content-Length with no body to wait for:
        answered where it lands). ``""``: it names this replica, which does not hold the session: it may have
        been parked, or adopted by another replica while this one restarted at the same address (look it up).
        None: answer it here."""
        if not self._tag or scope["method"] == "HEAD":
            return None
        sid = session_of(scope["path"])
        if sid is None or self.holds(sid):
            return None
        owner = self.owner(sid)
        if owner is None:  # this replica's id (or no replica's): parked or moved, or unknown
            return "" if sid.endswith(self._tag) else None
        if any(k == _FORWARDED for k, _ in scope["headers"]):
            return None
        return self.moved.get(sid, owner)

    def where(self, sid: str | None) -> str | None:
        """The other replica holding ``sid`` as far as this one knows (the one its id names, or the one that
        adopted it from there); None when it is this one, or the id names none."""
        owner = self.owner(sid)
        if owner is None or self.holds(sid):  # type: ignore[arg-type]  # owner() is None whenever sid is
            return None
        return self.moved.get(sid, owner)  # type: ignore[arg-type]  # as above

    def remember_move(self, sid: str, replica: str) -> None:
        if len(self.moved) >= 100_000:  # a bound, not a cache policy: a forgotten move is looked up again
            self.moved.clear()
        self.moved[sid] = replica

    def _request_headers(self, raw: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
        return [(k, v) for k, v in raw if k.lower() not in _SKIP] + [(_FORWARDED, self.public_url.encode())]

    def _unreachable(self, owner: str, exc: BaseException) -> GatewayError:
        # Retry-After: a replica on its way out answers nothing between closing its socket and parking its
        # sessions (handoff.py); a retry a moment later finds them parked.
        return GatewayError(
            502,
            f"the gateway replica holding this session ({owner}) did not answer: {exc}",
            code="replica_unreachable",
            retry_after_s=1,
        )

    async def _call(
        self,
        owner: str,
        method: str,
        path: str,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        on_answer: Callable[[int, list[tuple[bytes, bytes]] | None, bytes], None],
    ) -> None:
        """One request to ``owner`` over the transport's keep-alive pool, its answer streamed to ``on_answer``."""
        if self.transport is None:
            raise GatewayError(502, "this gateway has no transport to reach its peers", code="replica_unreachable")
        try:
            await self.transport.relay(method, owner, path, self._request_headers(headers), body, on_answer)
        except PodConnectionError as exc:
            raise self._unreachable(owner, exc) from None

    async def forward(self, owner: str, scope, body: bytes, send) -> None:
        """Send this request (its ``body`` read and checked by the caller) to ``owner`` and relay the answer
        back piece by piece as it arrives (SSE streams stay streams).

        Timing: ``scope["state"]["pod_wait_s"]`` gets the owner's own pod wait (its Server-Timing ``pod``), so
        the added latency this replica reports is what both gateways added; a stream, whose timing the owner
        cannot know when it starts, counts the owner's whole answer as waiting. ``state["relayed"]`` files the
        request under ``wire="relay"``. Raises GatewayError(502) when the owner cannot be reached."""
        path = scope["raw_path"].decode("latin-1")
        if scope.get("query_string"):
            path += "?" + scope["query_string"].decode("latin-1")
        state = scope["state"]
        state["relayed"] = True
        started = time.perf_counter()
        pieces: asyncio.Queue = asyncio.Queue()
        call = asyncio.ensure_future(
            self._call(owner, scope["method"], path, scope["headers"], body, lambda *piece: pieces.put_nowait(piece))
        )
        call.add_done_callback(lambda _: pieces.put_nowait(None))
        try:
            while (piece := await pieces.get()) is not None:
                status, headers, data = piece
                if headers is not None:
                    state["relay_answered"] = True  # from here on a failure cannot be answered another way
                    timing = next((v for k, v in headers if k == b"server-timing"), b"").decode("latin-1")
                    owner_pod_ms = _duration(timing, "pod")
                    if owner_pod_ms is not None:
                        state["pod_wait_s"] = owner_pod_ms / 1e3
                    await send(
                        {
                            "type": "http.response.start",
                            "status": status,
                            "headers": [(k, v) for k, v in headers if k not in _SKIP_ANSWER],
                        }
                    )
                elif data:
                    await send({"type": "http.response.body", "body": data, "more_body": True})
            await call  # raises the GatewayError of a failed call
        finally:
            call.cancel()
        state.setdefault("pod_wait_s", time.perf_counter() - started)
        await send({"type": "http.response.body", "body": b""})

    async def post_json(self, owner: str, path: str, body: dict, raw_headers: list[tuple[bytes, bytes]]) -> Any:
        """POST ``body`` to ``owner`` with the caller's headers (its API key); the decoded answer."""
        answer: list[bytes] = []
        status = 0

        def collect(code: int, headers, data: bytes) -> None:
            nonlocal status
            status = code or status  # the head carries the status, the body pieces 0
            answer.append(data)

        headers = [(k, v) for k, v in raw_headers if k.lower() != b"content-type"]
        await self._call(
            owner, "POST", path, headers + [(b"content-type", b"application/json")], json.dumps(body).encode(), collect
        )
        try:
            data = json.loads(b"".join(answer))
        except ValueError as exc:
            raise GatewayError(
                502, f"the gateway replica {owner} answered {path} with no JSON: {exc}", code="replica_unreachable"
            ) from None
        if status != 200:
            message = (data.get("error") or {}).get("message") if isinstance(data, dict) else None
            raise GatewayError(
                502,
                f"the gateway replica {owner} refused {path}: HTTP {status}: {message}",
                code="replica_unreachable",
            )
        return data
