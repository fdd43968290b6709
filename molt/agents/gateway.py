"""Client of the gateway's session API (docs/contracts.md, "Gateway").

A session is one episode: opened with its ids and sampling params, driven turn by turn (token-level
``generate`` for the step path, the OpenAI / Anthropic wires for the chat path), then finished with
the reward (the gateway writes the trajectory) or aborted (nothing written). ``GatewayClient.session``
is the safe way to hold one: any exception, cancellation or timeout inside it aborts the session, so
a failed episode never reaches the trainer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx

from molt.schema import check_reward

log = logging.getLogger(__name__)
FINISH_ATTEMPT_FLOOR_S = 20.0
"""The shortest a finish attempt may take, however little of ``finish_retry_s`` is left: a write under way is
not cut the moment the budget ends."""


class GatewayError(RuntimeError):
    """The gateway answered with an error status."""

    def __init__(self, method: str, path: str, status: int, body: str, retry_after_s: float | None = None) -> None:
        super().__init__(f"gateway {method} {path} -> {status}: {body[:500]}")
        self.status = status
        self.body = body
        self.retry_after_s = retry_after_s


class Session:
    """One open gateway session (its id is also the trajectory id)."""

    def __init__(self, client: GatewayClient, info: dict[str, Any]) -> None:
        self._client = client
        self.id: str = info["session_id"]
        self.openai_base_url: str = info["openai_base_url"]
        self.anthropic_base_url: str = info["anthropic_base_url"]
        self.finished: dict[str, Any] | None = None
        self.aborted = False

    async def generate(
        self,
        *,
        messages: list[dict[str, Any]] | None = None,
        append_text: str | None = None,
        append_token_ids: list[int] | None = None,
        sampling_params: dict[str, Any] | None = None,
        images: list[str] | None = None,
        truncate_prompt: str | None = None,
    ) -> dict[str, Any]:
        """One token-level turn: append (masked) input, then generate an action span. ``images``: data URLs, one
        per image token of the appended input, in order. ``truncate_prompt="left"`` (first turn only): a prompt
        that leaves no room to generate keeps its last tokens; the answer then carries ``prompt_text``."""
        body: dict[str, Any] = {}
        if truncate_prompt is not None:
            body["truncate_prompt"] = truncate_prompt
        if messages is not None:
            body["messages"] = messages
        if append_text:
            body["append_text"] = append_text
        if append_token_ids:
            body["append_token_ids"] = append_token_ids
        if sampling_params is not None:
            body["sampling_params"] = sampling_params
        if images:
            body["images"] = images
        return await self._client.request("POST", f"/v1/sessions/{self.id}/generate", body)

    async def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
        """``messages`` (and the row's ``tools``) rendered with the model's chat template and generation prompt, as
        the first turn's ``messages`` would be: Molt's pre-rendered prompt. Nothing is generated or recorded."""
        body: dict[str, Any] = {"messages": messages}
        if tools:
            body["tools"] = tools
        out = await self._client.request("POST", f"/v1/sessions/{self.id}/render", body)
        return out["text"]

    async def append(self, text: str, images: list[str] | None = None) -> dict[str, Any]:
        """Append masked text without generating (a turn with max_tokens 0; see GatewayClient.can_append). No pod
        sees it, so the gateway drops ``images`` and their image tokens."""
        out = await self.generate(append_text=text, sampling_params={"max_tokens": 0}, images=images)
        if out.get("token_ids"):
            raise GatewayError(
                "POST",
                f"/v1/sessions/{self.id}/generate",
                200,
                "the gateway generated tokens for max_tokens 0; the session holds an ungraded action",
            )
        return out

    async def summary(self) -> dict[str, Any]:
        return await self._client.request("GET", f"/v1/sessions/{self.id}")

    async def finish(
        self, reward: float, score: float | None = None, info: dict[str, float] | None = None, truncated: bool = False
    ) -> dict:
        """Write the trajectory with ``reward``; ``truncated``: the env or agent cut the episode short (the
        trajectory is then marked truncated, as when a turn hits the length limit). Idempotent on the gateway
        side (a finish whose answer was lost writes nothing twice), so a 503 (Redis down: the gateway kept the
        session open) or a lost connection is retried with backoff for up to the client's ``finish_retry_s``: a
        finished episode outlasts an outage.
        A reward or score that is not finite or past ``molt.schema.MAX_ABS_REWARD`` raises SchemaError here,
        before anything is written."""
        body: dict[str, Any] = {"reward": check_reward(reward, "reward"), "info": info or {}}
        if score is not None:
            body["score"] = check_reward(score, "score")
        if truncated:
            body["truncated"] = True
        path = f"/v1/sessions/{self.id}/finish"
        deadline = time.monotonic() + self._client.finish_retry_s
        delay = 0.25
        while True:
            # Each attempt ends with the retry budget (and FINISH_ATTEMPT_FLOOR_S past it at most), so a finish
            # is bounded by finish_retry_s, which the env worker reports and the trainer waits out.
            attempt_s = max(deadline - time.monotonic(), FINISH_ATTEMPT_FLOOR_S)
            try:
                self.finished = await self._client.request("POST", path, body, timeout_s=attempt_s)
                return self.finished
            except (GatewayError, httpx.TransportError) as err:
                status = getattr(err, "status", None)
                wait_s = min(max(getattr(err, "retry_after_s", None) or delay, 0.1), 5.0)
                if status not in (None, 502, 503, 504) or time.monotonic() + wait_s > deadline:
                    raise
                log.warning("finish of session %s: %s; again in %.1f s", self.id, err, wait_s)
                await asyncio.sleep(wait_s)
                delay = min(delay * 2, 5.0)

    async def abort(self) -> None:
        """Discard the session; nothing is written. Errors are logged, not raised (we are already failing)."""
        if self.aborted or self.finished is not None:
            return
        self.aborted = True
        try:
            await self._client.request("DELETE", f"/v1/sessions/{self.id}")
        except (GatewayError, httpx.HTTPError) as exc:  # the gateway's TTL reaps it anyway
            log.warning("abort of session %s failed: %s", self.id, exc)


class GatewayClient:
    """Async HTTP client of one gateway (``url`` is its root, e.g. http://127.0.0.1:8000)."""

    def __init__(
        self,
        url: str,
        timeout_s: float = 300.0,
        transport: httpx.AsyncBaseTransport | None = None,
        api_key: str | None = None,
        open_retry_s: float = 60.0,
        finish_retry_s: float = 300.0,
        lease_s: float | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.open_retry_s = open_retry_s
        self.finish_retry_s = finish_retry_s
        self.lease_s = lease_s
        """Sessions are opened with this lease and renewed every third of it while held (``session``): if this
        process dies, the gateway closes them after ``lease_s`` instead of its idle TTL. None: no lease."""
        # The gateway requires bearer keys whenever it listens beyond loopback; sessions belong to the key.
        self.api_key = api_key
        self._can_append: bool | None = None
        self._probe_lock = asyncio.Lock()
        self._http = httpx.AsyncClient(
            base_url=self.url,
            timeout=httpx.Timeout(timeout_s, connect=10.0),
            transport=transport,
            headers={"Authorization": f"Bearer {api_key}"} if api_key else None,
            # Few idle connections kept: httpcore's pool (1.0) walks every pooled connection for each idle one on
            # each request, quadratic in the pool's size, so a pool kept at the episodes' concurrency costs a busy
            # env worker much of its CPU; a fresh connection to the gateway is far cheaper.
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=16),
        )

    async def request(
        self, method: str, path: str, body: dict[str, Any] | None = None, timeout_s: float | None = None
    ) -> dict[str, Any]:
        """One call; ``timeout_s`` caps this call's read below the client's timeout."""
        timeout: Any = httpx.USE_CLIENT_DEFAULT
        if timeout_s is not None and timeout_s < (self._http.timeout.read or float("inf")):
            timeout = httpx.Timeout(timeout_s, connect=min(timeout_s, self._http.timeout.connect or timeout_s))
        resp = await self._http.request(method, path, json=body, timeout=timeout)
        if resp.status_code >= 400:
            retry = resp.headers.get("retry-after", "")
            raise GatewayError(
                method,
                path,
                resp.status_code,
                resp.text,
                float(retry) if retry.replace(".", "", 1).isdigit() else None,
            )
        return resp.json() if resp.content else {}

    async def open_session(self, **fields: Any) -> Session:
        """Open a session. A 503 opened nothing (the replica reached is draining, no rollout pod is ready yet,
        or the Redis that counts API keys' sessions is unreachable), so it is asked again after its Retry-After,
        for up to ``open_retry_s``."""
        deadline = time.monotonic() + self.open_retry_s
        if self.lease_s is not None:
            fields = {"lease_s": self.lease_s, **fields}
        while True:
            try:
                return Session(self, await self.request("POST", "/v1/sessions", fields))
            except (GatewayError, httpx.ConnectError) as err:  # refused: nothing was opened (gateway restarting)
                wait_s = min(max(getattr(err, "retry_after_s", None) or 1.0, 0.1), 5.0)
                if getattr(err, "status", 503) != 503 or time.monotonic() + wait_s > deadline:
                    raise
                log.info("open session: %s; again in %.1f s", err, wait_s)
                await asyncio.sleep(wait_s)

    @contextlib.asynccontextmanager
    async def session(self, **fields: Any) -> AsyncIterator[Session]:
        """Open a session; abort it unless the body finished it (on success, error, cancel or timeout)."""
        session = await self.open_session(**fields)
        renewing = asyncio.create_task(self._renew(session)) if self.lease_s is not None else None
        try:
            yield session
        finally:
            if renewing is not None:
                renewing.cancel()
            if session.finished is None:
                # shield: on a timeout the task is being cancelled; the abort must still go out.
                await asyncio.shield(session.abort())

    async def _renew(self, session: Session) -> None:
        """Renew ``session``'s lease every third of it until cancelled; a failed renewal is tried again at the
        next one (two in a row may fail before the lease lapses)."""
        assert self.lease_s is not None
        while True:
            await asyncio.sleep(self.lease_s / 3)
            try:
                await self.request("POST", f"/v1/sessions/{session.id}/renew")
            except (GatewayError, httpx.HTTPError) as exc:
                log.warning("could not renew the lease of session %s: %s", session.id, exc)

    async def can_append(self) -> bool:
        """Whether a generate with max_tokens 0 only appends (the terminal-feedback turn needs that).

        Probed once on a throwaway session of max_length 2 (at most one token is generated) that is
        then aborted, so nothing is written either way.
        """
        async with self._probe_lock:
            if self._can_append is None:
                async with self.session(group_id="molt-append-probe", max_length=2) as probe:
                    out = await probe.generate(append_text="x", sampling_params={"max_tokens": 0})
                self._can_append = not out.get("token_ids")
                if not self._can_append:
                    log.warning(
                        "gateway %s generates on max_tokens 0: the terminal turn's feedback (masked, no "
                        "effect on the loss) is not recorded",
                        self.url,
                    )
            return self._can_append

    async def healthy(self, timeout_s: float = 2.0, ready: bool = False) -> bool:
        """The gateway is up (``/healthz``); ``ready``: and can serve episodes end to end (``/readyz``: a healthy
        rollout pod, its Redis reachable, not draining)."""
        try:
            resp = await self._http.get("/readyz" if ready else "/healthz", timeout=timeout_s)
        except httpx.HTTPError:
            return False
        return resp.status_code == 200

    async def aclose(self) -> None:
        await self._http.aclose()
