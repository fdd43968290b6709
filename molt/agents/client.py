"""Dispatcher side of the env workers: spread episodes over replicas, honouring 429 + Retry-After.

A worker refuses work beyond its concurrency limit instead of queueing it. ``EnvWorkerPool.run``
starts at the next replica (round robin), moves on at once when one answers 429, and only when every
replica refused sleeps for the shortest Retry-After before the next round.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import httpx


class EnvWorkerError(RuntimeError):
    """A worker answered with an error other than 429 (e.g. a bad request or an unknown agent)."""


class EnvWorkerPool:
    def __init__(self, urls: list[str], timeout_s: float = 900.0, max_wait_s: float | None = None,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        if not urls:
            raise ValueError("EnvWorkerPool needs at least one worker URL")
        self.urls = [u.rstrip("/") for u in urls]
        self.max_wait_s = max_wait_s
        self._next = itertools.cycle(range(len(self.urls)))
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0), transport=transport,
                                       limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))
        self.rejections = 0

    async def run(self, request: dict[str, Any]) -> dict[str, Any]:
        """Run one episode (a POST /v1/episodes:run body) on some replica; returns its summary."""
        waited = 0.0
        while True:
            start = next(self._next)
            retry_after = []
            for k in range(len(self.urls)):
                url = self.urls[(start + k) % len(self.urls)]
                resp = await self._http.post(f"{url}/v1/episodes:run", json=request)
                if resp.status_code == 429:
                    self.rejections += 1
                    retry_after.append(float(resp.headers.get("retry-after") or 1))
                    continue
                if resp.status_code >= 400:
                    raise EnvWorkerError(f"{url}: {resp.status_code} {resp.text[:500]}")
                return resp.json()
            delay = max(min(retry_after), 0.05)
            if self.max_wait_s is not None and waited + delay > self.max_wait_s:
                raise EnvWorkerError(f"every env worker stayed saturated for {waited:.1f} s")
            await asyncio.sleep(delay)
            waited += delay

    async def aclose(self) -> None:
        await self._http.aclose()
