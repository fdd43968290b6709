"""The transport-agnostic core of an env worker: run one episode of a served agent, within limits.

- Admission: at most ``max_concurrency`` episodes at once; one more raises ``Saturated`` (HTTP 429 +
  Retry-After) instead of queueing, so a dispatcher can send it to another replica.
- Isolation: an exception in user code, a non-Result return or a timeout fails only that episode. The
  runner's session is aborted (nothing reaches the trainer), the failure is counted by status and the
  worker keeps serving.
- Reporting: a failed episode's response carries the exception's type and message (the dispatcher logs it and
  stops a run whose every episode fails with it), with this worker's own credentials masked.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import httpx
from pydantic import BaseModel, ConfigDict, Field, field_validator

from molt.agents.base import Episode, Runner, load_agent_runner, module_version
from molt.agents.env import IMAGES_ON_TOKEN_PATH, StepEnvRunner
from molt.agents.gateway import GatewayClient, GatewayError
from molt.images import from_data_url
from molt.metrics import Metrics
from molt.sampling import check_params
from molt.schema import SchemaError, check_reward

log = logging.getLogger(__name__)


class EpisodeRequest(BaseModel):
    """Body of POST /v1/episodes:run (docs/contracts.md, "Env worker")."""

    model_config = ConfigDict(extra="forbid")

    agent: str
    prompt: str | list[dict[str, Any]]
    label: Any = None
    group_id: str = Field(min_length=1)
    sample_index: int = Field(0, ge=0)
    sampling_params: dict[str, Any] | None = None
    max_length: int | None = Field(None, ge=2)
    tools: list[dict[str, Any]] | None = None
    images: list[str] | None = Field(None, max_length=64)
    """The row's images as data URLs (``data:image/png;base64,...``), in order; a ChatAgent gets them inlined."""
    eval: bool = False
    """An evaluation episode: graded as usual, its session aborted instead of finished (nothing is written)."""

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, prompt: str | list) -> str | list:
        if not prompt:
            raise ValueError("prompt is empty: send the question text or a non-empty message list")
        return prompt

    @field_validator("images")
    @classmethod
    def _decodable(cls, images: list[str] | None) -> list[str] | None:
        for i, url in enumerate(images or []):
            from_data_url(url, f"images[{i}]")  # a bad image is this request's 400, before any session opens
        return images or None

    @field_validator("sampling_params")
    @classmethod
    def _one_sample(cls, sp: dict | None) -> dict | None:
        if sp and sp.get("n", 1) != 1:
            raise ValueError("sampling_params.n must be 1: each sample is its own episode (use sample_index)")
        return check_params(sp, prefix="sampling_params.") if sp else sp  # vLLM's ranges, before any session opens


class EpisodeResponse(BaseModel):
    status: str
    """"ok", "failed" (user code or gateway error), "timeout", or "unavailable" (an outage stopped it: the
    gateway or its pods unreachable or answering 502-504; HTTP 503, the dispatcher waits and reruns it)."""
    reward: float = 0.0
    score: float | None = None
    turns: int = 0
    tokens: int = 0
    trajectory_id: str | None = None
    written: bool = False
    truncated: bool = False
    response_tokens: int = 0
    """Tokens the policy generated (Molt's eval response length)."""
    error: str | None = None


OUTAGE_STATUS = (502, 503, 504)
NOTHING_WRITTEN = (
    "nothing was written: the episode generated no tokens (the agent made no model call, or the prompt left no "
    "room to generate)"
)


def is_outage(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or what caused it) says a service was unavailable rather than the episode being wrong:
    a connection that failed or broke, or a 502/503/504 (our gateway client's error or an SDK's status error:
    a ChatAgent's openai / anthropic call fails with the gateway's 503 while no pod is healthy)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        status = exc.status if isinstance(exc, GatewayError) else getattr(exc, "status_code", None)
        if status in OUTAGE_STATUS or isinstance(exc, httpx.TransportError):
            return True
        if type(exc).__name__ == "APIConnectionError":  # openai's and anthropic's (connection refused, reset)
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def outage_status(exc: BaseException | None) -> int | None:
    """The 502/503/504 that ``exc`` (or what caused it) carries, or None (a connection that failed or broke)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        status = exc.status if isinstance(exc, GatewayError) else getattr(exc, "status_code", None)
        if status in OUTAGE_STATUS:
            return status
        exc = exc.__cause__ or exc.__context__
    return None


DROPPED = (
    "the gateway dropped the connection while it is up: it refuses some requests so, e.g. a body over its "
    "--session.max_body_bytes (a huge observation or message from the agent)"
)


def error_text(exc: BaseException, secrets: tuple[str, ...] = ()) -> str:
    """``Type: message`` of an episode's exception, as its response carries it. User code may quote this worker's
    credentials (an SDK's auth error echoes the key it sent): they are masked before the text leaves the worker."""
    text = f"{type(exc).__name__}: {exc}"
    for secret in secrets:
        text = text.replace(secret, "***")
    return text[:2000]


class DeadlinePassed(TimeoutError):
    """The episode's deadline passed before its finish was sent (user code held the event loop past it)."""


async def _lift(deadline: asyncio.Timeout) -> None:
    """``Episode.before_finish``: the reward is decided, so the finish runs to its end under its own bounds
    (``--envs.finish_retry_s``, the gateway timeout). A deadline firing mid-finish would report the episode timed
    out (and the dispatcher would run it again) while the gateway may have written its trajectory already."""
    if deadline.expired():
        await asyncio.sleep(0)  # its cancellation, if user code has not swallowed it, is raised here
        raise DeadlinePassed()
    when = deadline.when()
    if when is not None and when <= asyncio.get_running_loop().time():  # due, not fired: the loop was blocked
        raise DeadlinePassed()
    deadline.reschedule(None)


class Saturated(Exception):
    """The worker runs max_concurrency episodes already."""


class UnknownAgent(ValueError):
    pass


class Unsupported(ValueError):
    """A well-formed request the served agent cannot run (images for an Env)."""


class EpisodeWorker:
    def __init__(
        self,
        agents: dict[str, str],
        gateway: GatewayClient,
        metrics: Metrics,
        max_concurrency: int,
        episode_timeout_s: float,
        max_new_tokens: int | None = None,
        max_length: int | None = None,
        secrets: tuple[str | None, ...] = (),
    ) -> None:
        """``secrets``: values masked in the errors episodes report (the gateway key, the service token)."""
        self.runners: dict[str, Runner] = {name: load_agent_runner(path, name) for name, path in agents.items()}
        self.versions = {name: module_version(path) for name, path in agents.items()}
        self.gateway = gateway
        self.metrics = metrics
        self.max_concurrency = max_concurrency
        self.episode_timeout_s = episode_timeout_s
        self.max_new_tokens = max_new_tokens
        self.max_length = max_length
        self.inflight = 0
        self.running: dict[asyncio.Task[Any], tuple[Episode, float]] = {}
        """The episodes in flight by the task that runs them, and when each started (the loop watchdog names them)."""
        self.secrets = tuple(v for v in secrets if v)

    def _episode(self, req: EpisodeRequest) -> tuple[Runner, Episode]:
        runner = self.runners.get(req.agent)
        if runner is None:
            raise UnknownAgent(f"unknown agent {req.agent!r}; this worker serves {sorted(self.runners)}")
        if req.images and isinstance(runner, StepEnvRunner) and isinstance(req.prompt, str):
            raise Unsupported(IMAGES_ON_TOKEN_PATH.format(name=req.agent, why="this prompt is a string"))
        return runner, Episode(
            prompt=req.prompt,
            group_id=req.group_id,
            sample_index=req.sample_index,
            label=req.label,
            sampling_params=dict(req.sampling_params or {}),
            max_length=req.max_length if req.max_length is not None else self.max_length,
            max_new_tokens=self.max_new_tokens,
            tools=req.tools,
            images=req.images,
            env_name=req.agent,
            env_version=self.versions[req.agent],
            eval=req.eval,
        )

    async def run(self, req: EpisodeRequest) -> EpisodeResponse:
        runner, episode = self._episode(req)
        if self.inflight >= self.max_concurrency:
            self.metrics["molt_envs_rejected_total"].inc()
            raise Saturated()
        self.inflight += 1
        self.metrics["molt_envs_inflight_episodes"].set(self.inflight)
        start = time.monotonic()
        task = asyncio.current_task()
        if task is not None:
            self.running[task] = (episode, start)
        try:
            resp = await self._run(runner, episode)
        finally:
            if task is not None:
                self.running.pop(task, None)
            self.inflight -= 1
            self.metrics["molt_envs_inflight_episodes"].set(self.inflight)
        self.metrics["molt_envs_episodes_total"].labels(req.agent, resp.status).inc()
        self.metrics["molt_envs_episode_seconds"].labels(req.agent).observe(time.monotonic() - start)
        if resp.status == "ok":
            self.metrics["molt_envs_reward"].labels(req.agent).observe(resp.reward)
        return resp

    async def _run(self, runner: Runner, episode: Episode) -> EpisodeResponse:
        deadline = asyncio.timeout(self.episode_timeout_s)
        episode.before_finish = lambda: _lift(deadline)
        try:
            async with deadline:
                out = await runner.execute(episode, self.gateway)
        except Exception as exc:  # user code: fail this episode only; the runner aborted its session
            if isinstance(exc, TimeoutError) and (deadline.expired() or isinstance(exc, DeadlinePassed)):
                log.warning(
                    "episode %s (%s) timed out after %.1f s; session aborted",
                    episode.trajectory_id,
                    episode.env_name,
                    self.episode_timeout_s,
                )
                return EpisodeResponse(
                    status="timeout",
                    trajectory_id=episode.trajectory_id,
                    error=f"episode exceeded --envs.episode_timeout_s={self.episode_timeout_s:g}",
                )
            # A broken connection while the gateway answers its health probe was this episode's doing (the gateway
            # answers an oversized body by closing the connection mid-upload): as an outage it would be run
            # again, the same way, forever.
            if is_outage(exc) and outage_status(exc) is None and await self.gateway.healthy():
                log.error(
                    "episode %s (%s) failed; session aborted: %s (%s)",
                    episode.trajectory_id,
                    episode.env_name,
                    DROPPED,
                    error_text(exc, self.secrets)[:300],
                )
                return EpisodeResponse(
                    status="failed",
                    trajectory_id=episode.trajectory_id,
                    error=f"{DROPPED}; {error_text(exc, self.secrets)[:1500]}",
                )
            if is_outage(exc):
                log.warning(
                    "episode %s (%s) stopped by an outage, session aborted (the dispatcher reruns it): %s",
                    episode.trajectory_id,
                    episode.env_name,
                    error_text(exc, self.secrets)[:300],
                )
                return EpisodeResponse(
                    status="unavailable", trajectory_id=episode.trajectory_id, error=error_text(exc, self.secrets)
                )
            log.exception("episode %s (%s) failed; session aborted", episode.trajectory_id, episode.env_name)
            return EpisodeResponse(
                status="failed", trajectory_id=episode.trajectory_id, error=error_text(exc, self.secrets)
            )
        try:  # a custom runner may skip the gateway's check: nothing unbounded leaves this worker
            check_reward(out.reward, "reward")
            if out.score is not None:
                check_reward(out.score, "score")
        except SchemaError as exc:
            log.error("episode %s (%s): %s", episode.trajectory_id, episode.env_name, exc)
            return EpisodeResponse(status="failed", trajectory_id=episode.trajectory_id, error=str(exc))
        if not out.written and not episode.eval:
            # The dispatcher retries such an episode and logs this text when it gives up: without it the reason
            # would read "ok".
            log.warning("episode %s (%s): %s", episode.trajectory_id, episode.env_name, NOTHING_WRITTEN)
        return EpisodeResponse(
            status="ok",
            error=None if out.written or episode.eval else NOTHING_WRITTEN,
            reward=out.reward,
            score=out.score,
            turns=out.turns,
            tokens=out.tokens,
            trajectory_id=out.trajectory_id,
            written=out.written,
            truncated=out.truncated,
            response_tokens=out.response_tokens,
        )
