"""In-memory trajectory bus with the Redis semantics, for unit tests and single-process tools.

Records are stored encoded (so a test sees the same validation and dead-lettering as with Redis);
one consumer group; ``idle`` times come from a monotonic clock that tests may replace.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from molt.bus.base import Delivery, QueueFull, QueueLag, TrajectoryQueue
from molt.schema import SchemaError, decode


@dataclass
class _Pending:
    consumer: str
    delivered_at: float
    count: int


class MemoryTrajectoryQueue(TrajectoryQueue):
    def __init__(
        self, stream: str = "memory", max_len: int = 100_000, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.stream = stream
        self.dead_letter_stream = f"{stream}:dead"
        self.max_len = max_len
        self.clock = clock
        self.entries: dict[str, tuple[bytes, float]] = {}  # entry id -> (payload, added at)
        self.order: list[str] = []
        self.cursor = 0  # index in order of the next undelivered entry
        self.pending: dict[str, _Pending] = {}
        self.consumed_ids: set[str] = set()
        self.dead: list[dict] = []
        self._seq = 0
        self._changed = asyncio.Condition()
        self.written: dict[str, float] = {}  # put_once's record id -> when its marker lapses

    async def put_once(
        self, payloads: list[bytes], record_ids: list[str], keep_s: float, timeout_s: float | None = None
    ) -> list[str]:
        now = self.clock()
        new = [i for i, rid in enumerate(record_ids) if self.written.get(rid, now) <= now]
        ids = iter(await self.put_encoded([payloads[i] for i in new], timeout_s))
        for i in new:
            self.written[record_ids[i]] = now + keep_s
        fresh = set(new)
        return [next(ids) if i in fresh else "" for i in range(len(record_ids))]

    def put_raw(self, payload: bytes) -> str:
        """Append bytes as they are (tests use it to inject corrupt records)."""
        self._seq += 1
        entry_id = f"{self._seq}-0"
        self.entries[entry_id] = (payload, self.clock())
        self.order.append(entry_id)
        return entry_id

    async def put_encoded(self, payloads: list[bytes], timeout_s: float | None = None) -> list[str]:
        deadline = self.clock() + (60.0 if timeout_s is None else timeout_s)
        async with self._changed:
            while len(self.entries) >= self.max_len:
                remaining = deadline - self.clock()
                if remaining <= 0:
                    raise QueueFull(f"stream {self.stream!r} holds {len(self.entries)} entries (max {self.max_len})")
                try:
                    await asyncio.wait_for(self._changed.wait(), remaining)
                except TimeoutError:
                    pass
            ids = [self.put_raw(p) for p in payloads]
            self._changed.notify_all()
        return ids

    def _deliver(self, entry_ids: list[str], consumer: str) -> list[Delivery]:
        out, seen = [], set()
        for entry_id in entry_ids:
            payload, _ = self.entries[entry_id]
            p = self.pending.get(entry_id)
            self.pending[entry_id] = _Pending(consumer, self.clock(), (p.count + 1) if p else 1)
            try:
                traj = decode(payload)
            except SchemaError as exc:
                self.dead.append({"d": payload, "error": str(exc), "source_id": entry_id})
                self._drop(entry_id)
                continue
            tid = traj.trajectory_id
            if tid in self.consumed_ids or tid in seen:
                self._drop(entry_id)
                continue
            seen.add(tid)
            out.append(Delivery(entry_id, traj, self.pending[entry_id].count))
        return out

    def _drop(self, entry_id: str) -> None:
        self.pending.pop(entry_id, None)
        self.entries.pop(entry_id, None)

    async def read(self, consumer: str, count: int, block_s: float = 1.0) -> list[Delivery]:
        async with self._changed:
            if self.cursor >= len(self.order) and block_s > 0:
                try:
                    await asyncio.wait_for(self._changed.wait(), block_s)
                except TimeoutError:
                    pass
            batch = [e for e in self.order[self.cursor : self.cursor + count] if e in self.entries]
            self.cursor = min(self.cursor + count, len(self.order))
            out = self._deliver(batch, consumer)
            self._changed.notify_all()
            return out

    async def read_pending(self, consumer: str, count: int) -> list[Delivery]:
        mine = [e for e, p in self.pending.items() if p.consumer == consumer][:count]
        return self._deliver(mine, consumer)

    async def reclaim(self, consumer: str, min_idle_s: float, count: int) -> list[Delivery]:
        now = self.clock()
        stale = [e for e, p in self.pending.items() if p.consumer != consumer and now - p.delivered_at >= min_idle_s][
            :count
        ]
        return self._deliver(stale, consumer)

    async def ack(self, deliveries: Iterable[Delivery]) -> None:
        async with self._changed:
            for d in deliveries:
                self.consumed_ids.add(d.trajectory.trajectory_id)
                self._drop(d.entry_id)
            self._changed.notify_all()

    async def consumed(self, trajectory_ids: Iterable[str]) -> list[bool]:
        return [t in self.consumed_ids for t in trajectory_ids]

    async def lag(self) -> QueueLag:
        undelivered_ids = [e for e in self.order[self.cursor :] if e in self.entries]
        unacked = list(self.pending) + undelivered_ids
        oldest = min((self.entries[e][1] for e in unacked if e in self.entries), default=None)
        age = self.clock() - oldest if oldest is not None else 0.0
        return QueueLag(len(self.entries), len(self.pending), len(undelivered_ids), max(age, 0.0))
