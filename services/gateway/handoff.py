"""Open sessions outlive the replica that held them: parked in Redis when it exits, adopted by the next one.

A session's token trace lives in the memory of one gateway process. Without this, a replica that stops (a
rolling update, a scale-down, a restart) loses every episode still open when its ``--session.drain_s`` runs
out. With the trajectory stream on Redis (and ``--session.handoff``, the default):

- **Parking** (at exit, ``Gateway.shut_down``): each open session's whole state (its token-exact segments, the
  chat state the next turn's prefix test compares against, the last answer an identical retry gets back,
  its metadata and events) goes to ``{stream}:gateway:handoff:{id}``, expiring when its idle TTL would have.
- **Adopting:** a replica asked for a session it does not hold takes that key if the request's API key is the
  session's (compared by a hash: the key itself is not stored). The take is one script (read, check, delete),
  so exactly one replica adopts a session; it then holds it as if it had opened it. With several replicas it
  writes ``{stream}:gateway:moved:{id}`` (its own URL) for its peers.
- **Routing** (replicas.py): a replica that relays a request to the replica its id names, and finds it gone,
  adopts the session itself or relays to the replica the moved key names. One replica restarting onto the
  same Redis adopts its own sessions back the same way: the id is just not found locally.
"""

from __future__ import annotations

import hashlib
from typing import Any

# KEYS[1]: the parked session, KEYS[2]: its moved marker. ARGV: the owner tag, the adopter's URL ('' for none),
# the marker's TTL in seconds. The parked state, or false (none, or another key's: the same answer).
_TAKE = """
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] then return false end
local state = redis.call('HGET', KEYS[1], 'state')
redis.call('DEL', KEYS[1])
if ARGV[2] ~= '' then redis.call('SET', KEYS[2], ARGV[2], 'EX', tonumber(ARGV[3])) end
return state
"""

MOVED_TTL_S = 24 * 3600
"""How long a moved marker lasts: a session adopted by another replica is followed there this long after
the adoption (a later request reaching a third replica is otherwise a 502 ``replica_unreachable``)."""


def owner_tag(owner: str | None) -> str:
    """What is stored of a session's API key: a hash, or '' for an open (keyless) gateway."""
    return "" if owner is None else hashlib.sha256(owner.encode()).hexdigest()[:32]


class SessionHandoff:
    """The parked sessions of the gateways writing to ``stream``, in its Redis."""

    def __init__(self, redis: Any, stream: str, public_url: str = "") -> None:
        self.redis = redis
        self.stream = stream
        self.public_url = public_url
        self._take = redis.register_script(_TAKE)

    def key(self, sid: str) -> str:
        return f"{self.stream}:gateway:handoff:{sid}"

    def moved_key(self, sid: str) -> str:
        return f"{self.stream}:gateway:moved:{sid}"

    async def park(self, parked: list[tuple[str, str | None, float, bytes]]) -> None:
        """Store (session id, owner, seconds to keep, state) for each; all or raise."""
        for i in range(0, len(parked), 500):
            pipe = self.redis.pipeline(transaction=False)
            for sid, owner, ttl_s, state in parked[i:i + 500]:
                key = self.key(sid)
                pipe.delete(key)
                pipe.hset(key, mapping={"owner": owner_tag(owner), "state": state})
                pipe.expire(key, max(1, int(ttl_s)))
            await pipe.execute()

    async def take(self, sid: str, owner: str | None) -> bytes | None:
        """The parked state of ``sid`` if ``owner`` holds it (it is no longer parked then), else None."""
        state = await self._take(keys=[self.key(sid), self.moved_key(sid)],
                                 args=[owner_tag(owner), self.public_url, MOVED_TTL_S])
        return state or None

    async def moved_to(self, sid: str) -> str | None:
        """The URL of the replica that adopted ``sid``, if one did."""
        url = await self.redis.get(self.moved_key(sid))
        return url.decode() if isinstance(url, bytes) else url
