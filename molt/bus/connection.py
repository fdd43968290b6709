"""One way to open a Redis client for every service, tuned for outages and bursts.

- **Bursts wait, they do not fail.** redis-py's default pool refuses the 101st concurrent command
  ("Too many connections"): 500 session opens at once got 400 errors. A blocking pool queues a command for
  a free connection for up to ``pool_wait_s`` instead.
- **A restart is noticed at once.** A connection idle longer than ``health_check_s`` is pinged before use;
  one the server closed is replaced when it is taken from the pool. A failed command is retried a few times
  with a short jittered backoff (under a second in all), so a blip is absorbed and a real outage fails fast
  enough for a caller to answer 503 + Retry-After instead of hanging.
- Retries repeat a pipeline as a whole: a write that must land once (the gateway's finish) WATCHes its
  marker keys, which makes redis-py raise instead of resending it (``RedisTrajectoryQueue.put_once``).
"""

from __future__ import annotations

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import ConnectionError, TimeoutError

MAX_CONNECTIONS = 256
"""Connections one client opens at most; more concurrent commands wait for one (``pool_wait_s``)."""


def connect(
    url: str,
    *,
    max_connections: int = MAX_CONNECTIONS,
    pool_wait_s: float = 30.0,
    health_check_s: int = 5,
    socket_timeout_s: float = 10.0,
    retries: int = 3,
) -> aioredis.Redis:
    """An asyncio client of ``url`` that owns its (blocking) pool: ``await client.aclose()`` closes both.
    ``socket_timeout_s`` bounds one reply, so it must exceed any blocking read's ``BLOCK``."""
    pool = aioredis.BlockingConnectionPool.from_url(
        url,
        max_connections=max_connections,
        timeout=pool_wait_s,
        health_check_interval=health_check_s,
        socket_timeout=socket_timeout_s,
        socket_connect_timeout=2.0,
        socket_keepalive=True,
        retry=Retry(ExponentialWithJitterBackoff(base=0.05, cap=0.5), retries),
        retry_on_error=[ConnectionError, TimeoutError, OSError],
    )
    return aioredis.Redis.from_pool(pool)
