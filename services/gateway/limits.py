"""Per-API-key limits on open sessions (``--auth.max_open_sessions_per_key``), counted across every replica.

A key's limit is the deployment's, not each replica's: with the trajectory stream on Redis, every replica
counts in one sorted set per key, ``{stream}:gateway:open:{sha256(key)[:16]}``, whose members are session ids
and whose scores are the times (Redis server time, so replicas' clocks do not matter) their entries lapse.
- Opening checks the count and adds the session in one script, so two replicas never both take the last slot.
- Closing a session (finish, delete, idle expiry) removes it.
- The replica holding a session renews its entry every ``--auth.session_lease_s / 3``; a replica that dies
  without closing its sessions frees their slots once their lease lapses. (A replica cut off from Redis for
  longer than the lease has its entries lapse too: those sessions then no longer count against their keys.)
Without Redis (``--redis.url memory://``, one process) the count is kept in memory.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

log = logging.getLogger("molt.gateway.limits")

# KEYS[1]: the key's set. ARGV: lease seconds, limit, session id. 1: taken (or already held), 0: full.
_ACQUIRE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZSCORE', KEYS[1], ARGV[3]) then return 1 end
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[2]) then return 0 end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[1]), ARGV[3])
redis.call('PEXPIRE', KEYS[1], math.ceil(tonumber(ARGV[1]) * 1000))
return 1
"""

# KEYS[1]: the key's set. ARGV: lease seconds, then the session ids this replica holds under that key. XX: a
# renewal only extends entries that are there, so one on its way while a session closes cannot bring it back.
_RENEW = """
local t = redis.call('TIME')
local deadline = tonumber(t[1]) + tonumber(t[2]) / 1e6 + tonumber(ARGV[1])
for i = 2, #ARGV do redis.call('ZADD', KEYS[1], 'XX', deadline, ARGV[i]) end
redis.call('PEXPIRE', KEYS[1], math.ceil(tonumber(ARGV[1]) * 1000))
return #ARGV - 1
"""


# KEYS[1]: the key's set. ARGV: lease seconds, session id. Counted whatever the count: a session adopted from a
# replica that exited (services/gateway/handoff.py) was accepted when it opened.
_HOLD = """
local t = redis.call('TIME')
redis.call('ZADD', KEYS[1], tonumber(t[1]) + tonumber(t[2]) / 1e6 + tonumber(ARGV[1]), ARGV[2])
redis.call('PEXPIRE', KEYS[1], math.ceil(tonumber(ARGV[1]) * 1000))
return 1
"""


def count_key(stream: str, owner: str) -> str:
    """The Redis sorted set counting ``owner``'s open sessions for the gateways writing to ``stream``."""
    return f"{stream}:gateway:open:{hashlib.sha256(owner.encode()).hexdigest()[:16]}"


class OpenSessions:
    """In-memory count: one replica. ``acquire`` / ``hold`` / ``release`` / ``renew`` are the interface."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.count: Counter[str] = Counter()

    async def acquire(self, owner: str, sid: str) -> bool:
        if self.count[owner] >= self.limit:
            return False
        self.count[owner] += 1
        return True

    async def hold(self, owner: str, sid: str) -> None:
        """Count ``sid`` against ``owner`` even past the limit (an adopted session, accepted when it opened)."""
        self.count[owner] += 1

    async def release(self, closed: Iterable[tuple[str, str]]) -> None:
        for owner, _ in closed:
            self.count[owner] -= 1
            if self.count[owner] <= 0:
                del self.count[owner]

    async def renew(self, held: dict[str, list[str]]) -> None:
        pass


class RedisOpenSessions(OpenSessions):
    """The count every replica shares, in Redis (see the module docstring)."""

    def __init__(self, redis: Any, stream: str, limit: int, lease_s: float) -> None:
        super().__init__(limit)
        self.redis = redis
        self.stream = stream
        self.lease_s = lease_s
        self._acquire = redis.register_script(_ACQUIRE)
        self._renew = redis.register_script(_RENEW)
        self._hold = redis.register_script(_HOLD)

    def key(self, owner: str) -> str:
        return count_key(self.stream, owner)

    async def acquire(self, owner: str, sid: str) -> bool:
        return bool(await self._acquire(keys=[self.key(owner)], args=[self.lease_s, self.limit, sid]))

    async def hold(self, owner: str, sid: str) -> None:
        await self._hold(keys=[self.key(owner)], args=[self.lease_s, sid])

    async def release(self, closed: Iterable[tuple[str, str]]) -> None:
        pipe = self.redis.pipeline(transaction=False)
        for owner, sid in closed:
            pipe.zrem(self.key(owner), sid)
        await pipe.execute()

    async def renew(self, held: dict[str, list[str]]) -> None:
        pipe = self.redis.pipeline(transaction=False)
        for owner, sids in held.items():
            for i in range(0, len(sids), 1000):
                await self._renew(keys=[self.key(owner)], args=[self.lease_s, *sids[i : i + 1000]], client=pipe)
        await pipe.execute()

    async def renew_loop(self, held: Callable[[], dict[str, list[str]]]) -> None:
        while True:
            await asyncio.sleep(self.lease_s / 3)
            sessions = held()
            if not sessions:
                continue
            try:
                await self.renew(sessions)
            except Exception as exc:  # noqa: BLE001 - the entries lapse after lease_s unless a later renewal gets through
                log.warning("could not renew the open-session count of %d keys in Redis: %s", len(sessions), exc)
