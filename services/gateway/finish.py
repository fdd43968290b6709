"""Finishing sessions into the trajectory stream: the outcome a runner reports, the Trajectory built from a
session's capture, and the write of a batch of them (each written once, however often a finish is retried).

These are plain functions over explicit inputs (a session, the model, the queue, the settings): the session
bookkeeping around them (looking sessions up, their locks, closing them, the per-key counts) is the lifecycle's
(lifecycle.py ``SessionLifecycle.finish_many``). What /readyz and /metrics read of the stream is here too: it
is the Redis a finish writes to.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any

from molt.bus import QueueFull, QueueUnavailable, TrajectoryQueue
from molt.metrics import Metrics
from molt.schema import Provenance, SchemaError, Trajectory, check_reward, encode_many
from services.gateway.chat import ChatModel, bad_request
from services.gateway.config import SessionConfig
from services.gateway.errors import GatewayError
from services.gateway.session import Session

log = logging.getLogger("molt.gateway")


def _finite(x: Any, name: str, optional: bool = False) -> float | None:
    if x is None and optional:
        return None
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
        raise bad_request(f"'{name}' must be a finite number, got {x!r}", name)
    return float(x)


def read_outcome(body: dict) -> tuple[float, float | None, dict, bool]:
    """A finish body's ``(reward, score, info, truncated)``, each checked: a 400 naming the field otherwise."""
    if not isinstance(body, dict):
        raise bad_request("expected an object {reward, score?, info?, truncated?}")
    try:  # bounded, not only finite: advantages are computed in float32 (molt.schema.MAX_ABS_REWARD)
        reward = check_reward(body.get("reward"), "reward")
        score = None if body.get("score") is None else check_reward(body["score"], "score")
    except SchemaError as exc:
        raise bad_request(str(exc), exc.field) from None
    info = body.get("info") or {}
    if not isinstance(info, dict):
        raise bad_request("'info' must be an object of numbers", "info")
    for k, v in info.items():
        _finite(v, f"info.{k}")
    truncated = body.get("truncated")
    if truncated is None:
        truncated = False
    elif not isinstance(truncated, bool):
        raise bad_request("'truncated' must be true or false", "truncated")
    return reward, score, {k: float(v) for k, v in info.items()}, truncated


def build_trajectory(
    s: Session,
    reward: float,
    score: float | None,
    info: dict,
    truncated: bool,
    served_model_name: str,
    model: ChatModel,
) -> Trajectory | None:
    """Session ``s`` as a Trajectory with that outcome; None when no segment of it generated a token."""
    segments = s.capture.trainable_segments()
    if not segments:
        return None
    versions = [v for seg in s.capture.segments for v in seg.versions]
    return Trajectory(
        trajectory_id=s.id,
        group_id=s.group_id,
        sample_index=s.sample_index,
        segments=segments,
        reward=reward,
        score=score,
        info=info,
        # Cut by the length limit here, or truncated by the env or agent (the runner says so at finish).
        status="truncated" if truncated or any(seg.truncated for seg in s.capture.segments) else "completed",
        provenance=Provenance(
            model=served_model_name + ":" + str(model.path),
            weight_version=max(versions),
            tokenizer_hash=model.tokenizer_hash,
            chat_template_hash=model.chat_template_hash,
            sampling_params=s.sampling_params,
            env_name=s.env_name,
            env_version=s.env_version,
        ),
        events=list(s.capture.events),
        images=s.capture.trainable_images(),
    )


async def write_batch(
    queue: TrajectoryQueue, metrics: Metrics, cfg: SessionConfig, finished: list[tuple[str, Trajectory | None]]
) -> list[dict]:
    """Write the trajectories of ``finished`` (session id, its trajectory or None: no tokens) in one batch; each
    one's result, in order (what a finish answers, and a repeated finish again)."""
    trajs = [t for _, t in finished if t is not None]
    entry_ids: list[str] = []
    if trajs:
        payloads = encode_many(trajs)  # once: the bytes written and their size
        entry_ids = await write_payloads(queue, metrics, cfg, payloads, [t.trajectory_id for t in trajs])
        metrics["molt_gateway_trajectories_written_total"].inc(len(trajs))
        metrics["molt_gateway_trajectory_bytes_total"].inc(sum(map(len, payloads)))
    it = iter(entry_ids)
    results = []
    for sid, t in finished:
        res: dict[str, Any] = {"session_id": sid, "trajectory_id": sid, "written": t is not None}
        if t is None:
            res["reason"] = "the session generated no tokens; nothing was written"
        else:
            entry_id = next(it)
            if entry_id:  # "": an earlier attempt whose answer was lost had written it
                res["entry_id"] = entry_id
            res["segments"] = len(t.segments)
            res["action_tokens"] = t.num_action_tokens
        results.append(res)
    return results


async def write_payloads(
    queue: TrajectoryQueue, metrics: Metrics, cfg: SessionConfig, payloads: list[bytes], trajectory_ids: list[str]
) -> list[str]:
    """Write finished trajectories, waiting up to ``--session.finish_wait_s`` for Redis to come back (or the
    trainer to drain a full stream). Each is written once however often this is retried (``put_once``). Still
    failing: 503 + Retry-After, and the sessions stay open with their trajectories for the caller's retry."""
    deadline = time.monotonic() + cfg.finish_wait_s
    delay = 0.05
    while True:
        try:
            return await queue.put_once(
                payloads, trajectory_ids, cfg.finished_keep_s, timeout_s=max(0.0, deadline - time.monotonic())
            )
        except (QueueUnavailable, QueueFull) as exc:
            metrics["molt_gateway_write_retries_total"].inc()
            if time.monotonic() + delay > deadline:
                log.warning(
                    "could not write %d finished trajectories: %s; answered 503, the sessions stay open for the retry",
                    len(payloads),
                    exc,
                )
                raise GatewayError(
                    503,
                    f"cannot write the trajectory now ({exc}); nothing is lost: the session "
                    "stays open, finish it again",
                    code="queue_unavailable",
                    retry_after_s=1,
                ) from None
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)


async def queue_reachable(queue: TrajectoryQueue, timeout_s: float = 1.0) -> bool:
    """Whether the trajectory stream's Redis answers now (a finish could be written)."""
    try:
        await asyncio.wait_for(queue.lag(), timeout_s)
        return True
    except Exception:  # noqa: BLE001 - unreachable, slow, or loading: not ready either way
        return False


async def refresh_queue_metrics(queue: TrajectoryQueue, metrics: Metrics) -> None:
    try:
        lag = await asyncio.wait_for(queue.lag(), timeout=2.0)
    except Exception as exc:  # noqa: BLE001 - a scrape must not fail because Redis is slow; the gauges just go stale
        log.warning("queue lag unavailable: %s", exc)
        return
    stream = queue.stream
    metrics["molt_queue_length_entries"].labels(stream).set(lag.length)
    metrics["molt_queue_pending_entries"].labels(stream).set(lag.pending)
    metrics["molt_queue_undelivered_entries"].labels(stream).set(lag.undelivered)
    metrics["molt_queue_oldest_unacked_age_seconds"].labels(stream).set(lag.oldest_unacked_age_s)
