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

import base64
import dataclasses
import hashlib
import json
import time
from typing import Any

import msgspec
import numpy as np

from services.gateway.capture import Capture, ChatState, SegmentState
from services.gateway.errors import UnreadableParkedSession
from services.gateway.session import Session, TurnResult

# KEYS[1]: the parked session, KEYS[2]: its moved marker. ARGV: the owner tag, the adopter's URL ('' for none),
# the marker's TTL in seconds. [state, segments] of the parked session, or false (none, or another key's:
# the same answer).
_TAKE = """
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] then return false end
local parked = redis.call('HMGET', KEYS[1], 'state', 'segments')
redis.call('DEL', KEYS[1])
if ARGV[2] ~= '' then redis.call('SET', KEYS[2], ARGV[2], 'EX', tonumber(ARGV[3])) end
return parked
"""

MOVED_TTL_S = 24 * 3600
"""How long a moved marker lasts unless renewed: the replica that adopted a session renews its marker while
the session is open (``Gateway.renew_moved``), so a request reaching a third replica can follow it there."""


PARKED_FORMAT = 1
"""Version of ``parked_state``: bump it when the parked state changes shape."""


def parked_state(s: Session) -> dict[str, bytes]:
    """Everything another replica needs to go on with the open session ``s``, as the fields of its parked hash:
    ``segments`` (the token-exact trace, all ints and finite logprobs: msgspec, 10x faster than json) and
    ``state`` (the rest, through the standard library: what a client sent, labels and sampling params with
    NaN included, comes back as it was)."""
    cap = s.capture
    state = json.dumps(
        {
            "format": PARKED_FORMAT,
            "id": s.id,
            "group_id": s.group_id,
            "sample_index": s.sample_index,
            "label": s.label,
            "env_name": s.env_name,
            "env_version": s.env_version,
            "sampling_params": s.sampling_params,
            "metadata": s.metadata,
            "created_at": s.created_at,
            "idle_s": time.monotonic() - s.last_used,
            "pod": s.pod,
            "turns": s.turns,
            "last_key": s.last_key,
            "lease_s": s.lease_s,
            "context_full": s.context_full,
            "replies": s.replies,
            "last_result": _fields(s.last_result) if s.last_result is not None else None,
            "capture": {
                "max_length": cap.max_length,
                "chat": _fields(cap.chat) if cap.chat is not None else None,
                "completion_text": cap.completion_text,
                "events": cap.events,
                "image_data": cap.image_data,
            },
        }
    ).encode()
    return {"state": state, "segments": msgspec.json.encode([_segment_fields(seg) for seg in cap.segments])}


def _segment_fields(seg: SegmentState) -> dict:
    """A segment's fields; MoE routing as nested lists of ints, the sampler's top-k as ids and little-endian
    float32 bytes (JSON has no -inf), each only where there is some (so replicas that predate them still read
    the sessions without)."""
    fields = _fields(seg)
    routed = fields.pop("routed_experts")
    if routed is not None:
        fields["routed_experts"] = routed.tolist()
    top_ids, top = fields.pop("top_ids"), fields.pop("top_logprobs")
    if top_ids is not None and top is not None:
        fields["top_ids"] = top_ids.tolist()
        fields["top_logprobs"] = base64.b64encode(np.ascontiguousarray(top, "<f4").tobytes()).decode("ascii")
    return fields


def _segment(fields: dict) -> SegmentState:
    routed = fields.get("routed_experts")
    top_ids = top = None
    if fields.get("top_ids") is not None and fields.get("top_logprobs") is not None:
        top_ids = np.asarray(fields["top_ids"], dtype=np.int32)
        top = np.frombuffer(base64.b64decode(fields["top_logprobs"]), "<f4").reshape(top_ids.shape).copy()
    return SegmentState(
        **dict(
            fields,
            spans=[tuple(x) for x in fields["spans"]],
            routed_experts=None if routed is None else np.asarray(routed, dtype=np.int16),
            top_ids=top_ids,
            top_logprobs=top,
            plain=fields.get("plain") is True,  # unknown (parked by a replica that predates it): not plain
        )
    )


def _fields(obj: Any) -> dict:
    """A dataclass's fields, not copied: ``dataclasses.asdict`` copies every element of every list one call at
    a time, thousands of calls for a long session."""
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


def session_from_state(state: bytes, segments: bytes, owner: str | None) -> Session:
    """The open session ``parked_state`` wrote, held by ``owner`` (the API key of the request adopting it).
    Raises UnreadableParkedSession."""
    try:
        d = json.loads(state)
        if d.get("format") != PARKED_FORMAT:
            raise ValueError(f"format {d.get('format')!r}, this replica reads {PARKED_FORMAT}")
        c = d["capture"]
        segs = [_segment(seg) for seg in msgspec.json.decode(segments)]
        capture = Capture(
            max_length=c["max_length"],
            segments=segs,
            chat=ChatState(**c["chat"]) if c["chat"] is not None else None,
            completion_text=c["completion_text"],
            events=c["events"],
            image_data=c.get("image_data") or {},
        )
        last = d["last_result"]
        return Session(
            id=d["id"],
            owner=owner,
            group_id=d["group_id"],
            sample_index=d["sample_index"],
            label=d["label"],
            env_name=d["env_name"],
            env_version=d["env_version"],
            sampling_params=d["sampling_params"],
            metadata=d["metadata"],
            capture=capture,
            created_at=d["created_at"],
            last_used=time.monotonic() - d["idle_s"],
            pod=d["pod"],
            turns=d["turns"],
            last_key=d["last_key"],
            lease_s=d.get("lease_s"),
            context_full=d.get("context_full", "error"),
            replies=d.get("replies", "parsed"),
            last_result=TurnResult(**last) if last is not None else None,
        )
    except (KeyError, TypeError, ValueError, AttributeError, msgspec.DecodeError) as exc:
        raise UnreadableParkedSession(f"unreadable parked session ({type(exc).__name__}: {exc})") from None


def owner_tag(owner: str | None) -> str:
    """What is stored of a session's API key: a hash, or '' for an open (keyless) gateway."""
    return "" if owner is None else hashlib.sha256(owner.encode()).hexdigest()[:32]


class SessionHandoff:
    """The parked sessions of the gateways writing to ``stream``, in its Redis."""

    def __init__(self, redis: Any, stream: str, public_url: str = "") -> None:
        self.redis = redis
        self.stream = stream
        self.public_url = public_url
        self.moved_ttl_s = MOVED_TTL_S
        self._take = redis.register_script(_TAKE)

    def key(self, sid: str) -> str:
        return f"{self.stream}:gateway:handoff:{sid}"

    def moved_key(self, sid: str) -> str:
        return f"{self.stream}:gateway:moved:{sid}"

    async def park(self, sessions: list[Session], idle_ttl_s: float) -> None:
        """Park each open session until it would have expired idle; all or raise."""
        for i in range(0, len(sessions), 500):
            pipe = self.redis.pipeline(transaction=False)
            for s in sessions[i : i + 500]:
                key = self.key(s.id)
                pipe.delete(key)
                pipe.hset(key, mapping={"owner": owner_tag(s.owner), **parked_state(s)})
                pipe.expire(key, max(1, int(idle_ttl_s - (time.monotonic() - s.last_used))))
            await pipe.execute()

    async def take(self, sid: str, owner: str | None) -> Session | None:
        """The session ``sid`` if it is parked under ``owner``'s key (it is no longer parked then), else None.
        Raises UnreadableParkedSession (it was taken off Redis all the same)."""
        parked = await self._take(
            keys=[self.key(sid), self.moved_key(sid)], args=[owner_tag(owner), self.public_url, self.moved_ttl_s]
        )
        if not parked:
            return None
        state, segments = parked
        return session_from_state(state or b"", segments or b"", owner)

    async def renew_moved(self, sids: list[str]) -> None:
        """Extend the moved markers of sessions this replica adopted and still holds."""
        pipe = self.redis.pipeline(transaction=False)
        for sid in sids:
            pipe.expire(self.moved_key(sid), self.moved_ttl_s)
        await pipe.execute()

    async def moved_to(self, sid: str) -> str | None:
        """The URL of the replica that adopted ``sid``, if one did."""
        url = await self.redis.get(self.moved_key(sid))
        return url.decode() if isinstance(url, bytes) else url
