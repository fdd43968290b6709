"""The trajectory bus: a small interface with a Redis Streams backend and an in-memory one."""

from __future__ import annotations

from molt.bus.base import Delivery, QueueFull, QueueLag, QueueUnavailable, TrajectoryQueue
from molt.config import RedisConfig
from molt.metrics import Metrics

# Catalog names a service that owns a queue registers on its Metrics.
QUEUE_METRICS = (
    "molt_queue_length_entries",
    "molt_queue_pending_entries",
    "molt_queue_undelivered_entries",
    "molt_queue_oldest_unacked_age_seconds",
    "molt_queue_dead_letter_total",
    "molt_queue_backpressure_wait_seconds_total",
)


def open_queue(cfg: RedisConfig, metrics: Metrics | None = None) -> TrajectoryQueue:
    """The queue ``cfg`` describes: ``memory://`` is in-process, anything else is a Redis URL."""
    if not cfg.url:
        raise ValueError("no Redis URL: pass --redis.url redis://HOST:PORT (the local stack starts one for you)")
    if cfg.url.startswith("memory://"):
        from molt.bus.memory import MemoryTrajectoryQueue

        return MemoryTrajectoryQueue(cfg.stream, cfg.max_len)
    from molt.bus.redis_stream import RedisTrajectoryQueue

    return RedisTrajectoryQueue(
        cfg.url,
        cfg.stream,
        cfg.group,
        cfg.max_len,
        cfg.dead_letter_stream,
        metrics,
        consumed_keep_s=cfg.consumed_keep_s,
    )


__all__ = ["Delivery", "QUEUE_METRICS", "QueueFull", "QueueLag", "QueueUnavailable", "TrajectoryQueue", "open_queue"]
