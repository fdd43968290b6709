"""Redis Streams implementation of the trajectory bus.

Layout, for a stream ``S`` and consumer group ``G``:
- ``S``: entries ``{d: <encoded trajectory>}`` (the trajectory id is inside the record);
- ``S:consumed:G:<k>``: sets of the trajectory ids the group committed in time bucket k (exactly-once filter),
  each expiring ``consumed_keep_s`` after its bucket, so the filter's memory is bounded by the commit rate;
- the dead-letter stream (default ``S:dead``): ``{d, error, source_id, source_stream}``.

Hot paths cost a round trip or two per batch, never one per record: a put is a pipeline of XADDs + XLEN
(the length feeds the backpressure check); a read is XREADGROUP COUNT n, then one script that returns
which ids the group already committed; a commit is one script doing XACK + SADD atomically. Id lists
travel to the scripts as one msgpack argument: redis-py packs every argument in Python, so 100 ids as
100 arguments cost more than the script. Payloads never pass through Lua: the server would copy each one
into the interpreter and out again, which costs more than the redis-py overhead it would save. Acked
entries are trimmed (XTRIM MINID below every group's oldest unacked entry) every ``trim_every`` acks,
so the stream length measures real backlog.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from typing import Any

import msgspec
from redis.exceptions import BusyLoadingError, OutOfMemoryError, ResponseError, WatchError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from molt.bus.base import Delivery, QueueFull, QueueLag, QueueUnavailable, TrajectoryQueue
from molt.bus.connection import connect
from molt.metrics import Metrics
from molt.schema import SchemaError, decode_many

# KEYS: the consumed sets still alive. ARGV: msgpack list of trajectory ids. Returns the 1-based positions of
# the ids already committed (possibly repeated): an empty reply in the common case. (SMISMEMBER, 6.2+, in
# chunks: Lua's unpack limit.)
_COMMITTED_HITS = """
local ids, hits = cmsgpack.unpack(ARGV[1]), {}
for _, key in ipairs(KEYS) do
  if redis.call('EXISTS', key) == 1 then
    for i = 1, #ids, 1000 do
      local found = redis.call('SMISMEMBER', key, unpack(ids, i, math.min(i + 999, #ids)))
      for j, member in ipairs(found) do
        if member == 1 then hits[#hits + 1] = i + j - 1 end
      end
    end
  end
end
return hits
"""

# KEYS: stream, this bucket's consumed set. ARGV: group, msgpack entry ids, msgpack trajectory ids, the set's
# time to live in ms. The commit: atomic.
_ACK = """
local ids, tids = cmsgpack.unpack(ARGV[2]), cmsgpack.unpack(ARGV[3])
for i = 1, #ids, 1000 do
  redis.call('XACK', KEYS[1], ARGV[1], unpack(ids, i, math.min(i + 999, #ids)))
end
for i = 1, #tids, 1000 do
  redis.call('SADD', KEYS[2], unpack(tids, i, math.min(i + 999, #tids)))
end
if #tids > 0 then redis.call('PEXPIRE', KEYS[2], ARGV[4]) end
return #ids
"""

CONSUMED_BUCKETS = 24
"""The exactly-once filter's time buckets per ``consumed_keep_s``: a read checks about this many sets."""

_pack = msgspec.msgpack.encode
log = logging.getLogger("molt.bus")


_LAG_COUNT_CAP = 100_000
"""Redis < 7: most undelivered entries counted one by one for the lag (the default --redis.max_len)."""


def _id_tuple(entry_id: bytes | str) -> tuple[int, int]:
    s = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    ms, _, seq = s.partition("-")
    return int(ms), int(seq or 0)


def _s(x: bytes | str) -> str:
    return x.decode() if isinstance(x, bytes) else x


class RedisTrajectoryQueue(TrajectoryQueue):
    transient_errors = (RedisConnectionError, RedisTimeoutError, BusyLoadingError, ConnectionError, TimeoutError)

    def __init__(
        self,
        url: str,
        stream: str,
        group: str = "trainer",
        max_len: int = 100_000,
        dead_letter_stream: str | None = None,
        metrics: Metrics | None = None,
        trim_every: int = 256,
        put_timeout_s: float = 60.0,
        consumed_keep_s: float = 86400.0,
    ) -> None:
        self.url = url
        self.stream = stream
        self.group = group
        self.max_len = max_len
        self.dead_letter_stream = dead_letter_stream or f"{stream}:dead"
        self.consumed_prefix = f"{stream}:consumed:{group}:"
        self.consumed_keep_s = consumed_keep_s
        self._bucket_s = consumed_keep_s / CONSUMED_BUCKETS
        self.metrics = metrics
        self.trim_every = trim_every
        self.put_timeout_s = put_timeout_s
        self.redis = connect(url)
        self._ack_script = self.redis.register_script(_ACK)
        self._committed_hits = self.redis.register_script(_COMMITTED_HITS)
        self._known_len = 0
        self._acks_since_trim = 0
        self._group_ready = False

    async def ensure_group(self) -> None:
        if self._group_ready:
            return
        try:
            await self.redis.xgroup_create(self.stream, self.group, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        self._group_ready = True

    # ---- producer side

    async def _wait_for_room(self, timeout_s: float) -> None:
        if self._known_len < self.max_len:
            return
        start = time.monotonic()
        delay = 0.01
        while True:
            self._known_len = await self.redis.xlen(self.stream)
            if self._known_len < self.max_len:
                break
            waited = time.monotonic() - start
            if waited >= timeout_s:
                raise QueueFull(
                    f"stream {self.stream!r} holds {self._known_len} entries (--redis.max_len {self.max_len}) "
                    f"and the trainer did not drain it within {timeout_s:.0f}s; nothing was written"
                )
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.5)
        if self.metrics:
            self.metrics["molt_queue_backpressure_wait_seconds_total"].labels(self.stream).inc(
                time.monotonic() - start
            )

    async def put_encoded(self, payloads: list[bytes], timeout_s: float | None = None) -> list[str]:
        await self._wait_for_room(self.put_timeout_s if timeout_s is None else timeout_s)
        pipe = self.redis.pipeline(transaction=False)
        for payload in payloads:
            pipe.execute_command("XADD", self.stream, "*", "d", payload)  # xadd() re-checks its arguments per call
        pipe.xlen(self.stream)
        *ids, self._known_len = await pipe.execute()
        return [_s(i) for i in ids]

    def written_key(self, record_id: str) -> str:
        return f"{self.stream}:written:{record_id}"

    async def put_once(
        self, payloads: list[bytes], record_ids: list[str], keep_s: float, timeout_s: float | None = None
    ) -> list[str]:
        """``put_encoded``, once per record id: each record goes in one MULTI with a marker
        ``{stream}:written:{id}`` that lives ``keep_s``, and a record whose marker is there already is not
        written again (its entry id comes back as ""). The markers are WATCHed, so a connection lost while the
        write is in flight raises (redis-py would otherwise resend it, and a write that landed before its reply
        was lost would land twice): a caller retries the same call until it returns. Raises QueueUnavailable
        when Redis cannot be reached, and QueueFull when the stream stays full (``--redis.max_len``, or Redis
        refusing writes at its ``maxmemory``) past ``timeout_s``."""
        assert len(payloads) == len(record_ids)
        timeout_s = self.put_timeout_s if timeout_s is None else timeout_s
        deadline, delay = time.monotonic() + timeout_s, 0.01
        while True:
            try:
                return await self._put_once(payloads, record_ids, keep_s, max(0.0, deadline - time.monotonic()))
            except OutOfMemoryError as exc:
                # Redis at its maxmemory (noeviction) refuses the whole MULTI. Entries the trainer acked hold
                # memory until trimmed, and the trainer trims only every trim_every acks: a drained stream
                # would stay full for good unless the producer trims them too.
                try:
                    await self.trim_acked()
                except (*self.transient_errors, OSError) as gone:
                    raise QueueUnavailable(f"Redis is unreachable ({type(gone).__name__}: {gone})") from gone
                if time.monotonic() + delay > deadline:
                    raise QueueFull(
                        f"Redis refuses writes at its maxmemory ({exc}) and the trainer did not drain stream "
                        f"{self.stream!r} within {timeout_s:.0f}s; nothing was written"
                    ) from None
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.5)

    async def _put_once(
        self, payloads: list[bytes], record_ids: list[str], keep_s: float, timeout_s: float
    ) -> list[str]:
        try:
            await self._wait_for_room(timeout_s)
            markers = [self.written_key(i) for i in record_ids]
            async with self.redis.pipeline(transaction=True) as pipe:
                await pipe.watch(*markers)
                done = await pipe.mget(markers)
                pipe.multi()
                for payload, marker, was in zip(payloads, markers, done):
                    if was is None:
                        pipe.execute_command("XADD", self.stream, "*", "d", payload)
                        pipe.set(marker, b"1", px=max(1, int(keep_s * 1000)))
                pipe.xlen(self.stream)
                *replies, self._known_len = await pipe.execute()
        except (*self.transient_errors, WatchError, OSError) as exc:
            raise QueueUnavailable(f"Redis is unreachable ({type(exc).__name__}: {exc})") from exc
        new = iter(replies[::2])
        return ["" if was is not None else _s(next(new)) for was in done]

    # ---- consumer side

    async def read(self, consumer: str, count: int, block_s: float = 1.0) -> list[Delivery]:
        await self.ensure_group()
        # Stream replies are typed here as what they are on the wire (their shape depends on the protocol
        # version, which redis-py's annotations model as a union no code can index).
        resp: Any = await self.redis.xreadgroup(
            self.group,
            consumer,
            {self.stream: ">"},
            count=count,
            block=max(int(block_s * 1000), 1) if block_s > 0 else None,
        )
        entries = resp[0][1] if resp else []
        return await self._deliver(entries)

    async def read_pending(self, consumer: str, count: int) -> list[Delivery]:
        await self.ensure_group()
        resp: Any = await self.redis.xreadgroup(self.group, consumer, {self.stream: "0"}, count=count)
        entries = resp[0][1] if resp else []
        return await self._deliver(entries, redelivered=True)

    async def reclaim(self, consumer: str, min_idle_s: float, count: int) -> list[Delivery]:
        # XPENDING + XCLAIM rather than XAUTOCLAIM: XAUTOCLAIM also takes idle entries from ``consumer``
        # itself, and a consumer's own entries are held for a reason (a batch waiting for its group, a step
        # not yet durable); reclaiming them would deliver them twice.
        await self.ensure_group()
        idle_ms = int(min_idle_s * 1000)
        ids: list[Any] = []  # entry ids (str), as redis-py's xclaim takes them
        start = "-"
        while len(ids) < count:
            rows: Any = await self.redis.xpending_range(self.stream, self.group, start, "+", 1000, idle=idle_ms)
            ids.extend(_s(r["message_id"]) for r in rows if _s(r["consumer"]) != consumer)
            if len(rows) < 1000:
                break
            ms, seq = _id_tuple(rows[-1]["message_id"])
            start = f"{ms}-{seq + 1}"
        claimed: list = []
        for i in range(0, min(len(ids), count), 1000):
            claimed.extend(
                await self.redis.xclaim(self.stream, self.group, consumer, idle_ms, ids[i : min(i + 1000, count)])
            )
        return await self._deliver([(entry_id, fields) for entry_id, fields in claimed], redelivered=True)

    async def _deliver(self, entries: list, redelivered: bool = False) -> list[Delivery]:
        ids: list[str] = []
        raws: list[bytes] = []
        gone: list[str] = []
        for entry_id, fields in entries:
            if fields:
                ids.append(_s(entry_id))
                raws.append(fields.get(b"d", b""))
            else:  # trimmed or deleted while pending: nothing left to deliver
                gone.append(_s(entry_id))
        good: list[Delivery] = []
        dead: list[tuple[str, bytes, str]] = []
        count = 2 if redelivered else 1
        for entry_id, raw, traj in zip(ids, raws, decode_many(raws)):
            if isinstance(traj, SchemaError):
                dead.append((entry_id, raw, str(traj)))
            else:
                good.append(Delivery(entry_id, traj, count))
        if dead or gone:
            try:
                await self._dead_letter(dead, gone)
            except OutOfMemoryError as exc:
                # Redis at its maxmemory refuses the dead-letter copy. Left pending, the entries would be read
                # again forever and hold back the trim that frees memory: they are acked with their errors logged.
                for entry_id, _, error in dead:
                    log.error(
                        "undecodable entry %s of %s acked without a dead-letter copy (%s): %s",
                        entry_id,
                        self.stream,
                        exc,
                        error,
                    )
                await self.redis.xack(self.stream, self.group, *[d[0] for d in dead], *gone)
            if dead and self.metrics:
                self.metrics["molt_queue_dead_letter_total"].labels(self.stream).inc(len(dead))
        if not good:
            return good
        # Exactly-once by trajectory id: skip (and ack) ids the group already committed, and repeats
        # of one id inside this batch (a producer that retried a write).
        seen = await self.consumed([d.trajectory.trajectory_id for d in good])
        fresh, dupes, in_batch = [], [], set()
        for d, was_seen in zip(good, seen):
            tid = d.trajectory.trajectory_id
            if was_seen or tid in in_batch:
                dupes.append(d.entry_id)
            else:
                in_batch.add(tid)
                fresh.append(d)
        if dupes:
            await self.redis.xack(self.stream, self.group, *dupes)
        return fresh

    def _consumed_keys(self, now_s: float) -> list[str]:
        """The consumed sets that may still hold an id committed within ``consumed_keep_s`` of ``now_s``."""
        first, last = int((now_s - self.consumed_keep_s) // self._bucket_s), int(now_s // self._bucket_s)
        return [f"{self.consumed_prefix}{k}" for k in range(first, last + 1)]

    async def _dead_letter(self, dead: list[tuple[str, bytes, str]], gone: list[str]) -> None:
        pipe = self.redis.pipeline(transaction=True)
        for entry_id, raw, error in dead:
            pipe.xadd(
                self.dead_letter_stream,
                {"d": raw, "error": error, "source_id": entry_id, "source_stream": self.stream},
            )
        pipe.xack(self.stream, self.group, *[d[0] for d in dead], *gone)
        await pipe.execute()

    async def consumed(self, trajectory_ids: Iterable[str]) -> list[bool]:
        """Which ids the group committed within ``consumed_keep_s``. The window only has to outlast the one in
        which a producer may write an id twice (the gateway's --session.finished_keep_s); remembering every id
        for good would grow Redis by every trajectory ever trained."""
        ids = list(trajectory_ids)
        if not ids:
            return []
        out = [False] * len(ids)
        keys = self._consumed_keys(time.time())
        for index in await self._committed_hits(keys=keys, args=[_pack(ids)]):
            out[int(index) - 1] = True
        return out

    async def ack(self, deliveries: Iterable[Delivery]) -> None:
        deliveries = list(deliveries)
        if not deliveries:
            return
        # A bucket's set lives keep_s past the bucket's end, so every id stays known at least keep_s.
        await self._ack_script(
            keys=[self.stream, self._consumed_keys(time.time())[-1]],
            args=[
                self.group,
                _pack([d.entry_id for d in deliveries]),
                _pack([d.trajectory.trajectory_id for d in deliveries]),
                max(1, int((self.consumed_keep_s + self._bucket_s) * 1000)),
            ],
        )
        self._acks_since_trim += len(deliveries)
        if self._acks_since_trim >= self.trim_every:
            self._acks_since_trim = 0
            await self.trim_acked()

    async def trim_acked(self) -> int:
        """Delete entries every group has acked; returns how many were removed."""
        groups: Any = await self.redis.xinfo_groups(self.stream)
        if not groups:
            return 0
        bounds = []
        for g in groups:
            name = g[b"name"] if b"name" in g else g["name"]
            summary = await self.redis.xpending(self.stream, name)
            if summary["pending"]:
                bounds.append(_id_tuple(summary["min"]))
            else:
                ms, seq = _id_tuple(g.get(b"last-delivered-id") or g.get("last-delivered-id"))
                bounds.append((ms, seq + 1))
        ms, seq = min(bounds)
        return await self.redis.xtrim(self.stream, minid=f"{ms}-{seq}", approximate=False)

    async def lag(self) -> QueueLag:
        await self.ensure_group()
        pipe = self.redis.pipeline(transaction=False)
        pipe.xlen(self.stream)
        pipe.xinfo_groups(self.stream)
        pipe.xpending(self.stream, self.group)
        pipe.time()
        replies: Any = await pipe.execute()
        length, groups, summary, (now_s, now_us) = replies
        now_ms = now_s * 1000 + now_us // 1000
        info = next(g for g in groups if _s(g.get(b"name") or g.get("name")) == self.group)
        pending = int(summary["pending"])
        undelivered = info.get(b"lag", info.get("lag"))
        last = _s(info.get(b"last-delivered-id") or info.get("last-delivered-id"))
        if undelivered is None:  # Redis < 7 has no per-group lag: count the entries after the last delivered one
            # (acked entries stay in the stream, so length - pending would never reach 0 and a trainer waiting
            # for the end of its dataset would wait forever). Capped: a backlog past the cap reads as the cap.
            ms, seq = _id_tuple(last)
            after: Any = await self.redis.xrange(self.stream, min=f"({ms}-{seq}", count=_LAG_COUNT_CAP)
            undelivered = len(after)
        oldest = None
        if pending:
            oldest = _id_tuple(summary["min"])
        elif undelivered:
            ms, seq = _id_tuple(last)
            first: Any = await self.redis.xrange(self.stream, min=f"({ms}-{seq}", count=1)
            oldest = _id_tuple(first[0][0]) if first else None
        age_s = max(0.0, (now_ms - oldest[0]) / 1000) if oldest else 0.0
        lag = QueueLag(int(length), pending, int(undelivered), age_s)
        if self.metrics:
            m = self.metrics
            m["molt_queue_length_entries"].labels(self.stream).set(lag.length)
            m["molt_queue_pending_entries"].labels(self.stream).set(lag.pending)
            m["molt_queue_undelivered_entries"].labels(self.stream).set(lag.undelivered)
            m["molt_queue_oldest_unacked_age_seconds"].labels(self.stream).set(lag.oldest_unacked_age_s)
        return lag

    async def delete(self) -> None:
        """Remove the stream and its companion keys (tests and run teardown)."""
        consumed = [key async for key in self.redis.scan_iter(match=self.consumed_prefix + "*")]
        await self.redis.delete(self.stream, self.dead_letter_stream, *consumed)

    async def close(self) -> None:
        await self.redis.aclose()
