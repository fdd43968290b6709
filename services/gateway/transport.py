"""How the gateway talks HTTP to rollout pods and to its peer replicas: a three-method interface and its
implementation on aiohttp's public client API (one keep-alive connection pool for every pod and peer).

``FakePods`` (tests/gateway_testlib.py) implements the same interface in memory for unit tests.
"""

from __future__ import annotations

import abc
import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import msgspec
import yarl

from molt.auth import bearer_headers

Sink = Callable[[int, list[tuple[bytes, bytes]] | None, bytes], None]
"""Receives a streamed answer: ``(status, headers, b"")`` once the head is in, then ``(0, None, piece)``."""


def json_loads(raw: bytes) -> Any:
    """``json.loads``, 3-5x faster: msgspec parses what it can, and the standard library takes whatever msgspec
    refuses (NaN, integers past 64 bits, malformed input), so what is accepted and the errors stay json's."""
    try:
        return msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return json.loads(raw)


def generate_body(prompt_ids: list[int], sampling_params: dict) -> bytes:
    """The /v1/generate request. The token ids (thousands on a long episode) are encoded by msgspec, much
    faster than json.dumps; the sampling params by json.dumps (NaN included, for the pod to refuse)."""
    try:
        ids = msgspec.json.encode(prompt_ids)
    except (OverflowError, msgspec.EncodeError, TypeError):
        ids = json.dumps(prompt_ids).encode()
    return b'{"prompt_token_ids":' + ids + b',"sampling_params":' + json.dumps(sampling_params).encode() + b"}"


class PodConnectionError(Exception):
    """The pod could not be reached or did not answer in time (connection refused/reset, timeout)."""


class PodTransport(abc.ABC):
    @abc.abstractmethod
    async def post_json(self, url: str, body: bytes) -> tuple[int, bytes, float]:
        """POST a JSON body; (status, response body, ``time.perf_counter()`` when the answer had fully arrived,
        so time spent queued on the event loop afterwards counts as the gateway's, not the pod's).
        Raises PodConnectionError on transport failure."""

    @abc.abstractmethod
    async def get(self, url: str, timeout_s: float) -> tuple[int, bytes]:
        """GET; the status and the body. Raises PodConnectionError on transport failure."""

    async def close(self) -> None:
        return None


_FAILURES = (aiohttp.ClientError, asyncio.TimeoutError, OSError)


class HttpTransport(PodTransport):
    KEEP_ALIVE_S = 4.0
    """Idle connections are closed after this: uvicorn (the pods' and peers' server) drops keep-alive
    connections after 5 s, and a request written into one the server is closing fails."""

    def __init__(
        self, max_connections: int, timeout_s: float, connect_timeout_s: float, pod_token: str | None = None
    ) -> None:
        self.max_connections = max_connections
        self.pod_token = pod_token
        """The service token (MOLT_INTERNAL_TOKEN) pods require on generate calls; sent to pods only, not peers."""
        self._post_headers = {"Content-Type": "application/json", **bearer_headers(pod_token)}
        self.timeout = aiohttp.ClientTimeout(total=timeout_s, connect=connect_timeout_s)
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        """Created on first use, inside the running event loop (aiohttp binds a session to its loop)."""
        if self._session is None:
            connector = aiohttp.TCPConnector(
                limit=self.max_connections, limit_per_host=0, keepalive_timeout=self.KEEP_ALIVE_S
            )
            # auto_decompress off: a relayed answer goes back byte for byte, with its own Content-Encoding.
            self._session = aiohttp.ClientSession(
                connector=connector,
                timeout=self.timeout,
                auto_decompress=False,
                skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding"),
            )
        return self._session

    async def post_json(self, url: str, body: bytes) -> tuple[int, bytes, float]:
        try:
            async with self.session.post(url, data=body, headers=self._post_headers) as resp:
                return resp.status, await resp.read(), time.perf_counter()
        except _FAILURES as exc:
            raise PodConnectionError(f"{type(exc).__name__}: {exc}") from None

    async def get(self, url: str, timeout_s: float) -> tuple[int, bytes]:
        try:
            async with self.session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                return resp.status, await resp.read()
        except _FAILURES as exc:
            raise PodConnectionError(f"{type(exc).__name__}: {exc}") from None

    async def relay(
        self, method: str, origin: str, path: str, headers: list[tuple[bytes, bytes]], body: bytes, sink: Sink
    ) -> None:
        """Send ``method path`` to ``origin`` (scheme://host:port) with the given headers (Host and
        Content-Length are set here) and stream the answer to ``sink`` as it arrives; returns when the answer
        is complete. Raises PodConnectionError on transport failure (the sink may already have the head: the
        answer was cut)."""
        sent = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in headers]
        try:
            async with self.session.request(
                method, yarl.URL(origin + path, encoded=True), headers=sent, data=body
            ) as resp:
                sink(resp.status, [(k.lower(), v) for k, v in resp.raw_headers], b"")
                async for piece in resp.content.iter_any():
                    sink(0, None, piece)
        except _FAILURES as exc:
            raise PodConnectionError(f"{type(exc).__name__}: {exc}") from None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
