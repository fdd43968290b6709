"""The trajectory bus interface: producers put trajectories, a consumer group trains on them.

Semantics every implementation keeps (the Redis one for real, the in-memory one for unit tests):
- at-least-once delivery inside a consumer group, made exactly-once by trajectory id: ``ack`` records
  the ids it commits, and any later delivery of an already-committed id is acked and skipped;
- nothing is acked until the consumer commits (the trainer acks after its step is durable);
- entries left pending by a dead consumer are taken over with ``reclaim`` (never a consumer's own: it holds
  them on purpose, and re-delivering them would train them twice);
- ``transient_errors`` are the exceptions of an outage of the backend (retry them, with backoff);
- a record that fails to decode goes to the dead-letter stream (never silently dropped);
- producers wait (backpressure) instead of trimming unacked data once the stream holds ``max_len``
  entries; acked entries are trimmed by the consumer side.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable
from dataclasses import dataclass

from molt.schema import Trajectory, encode_many


class QueueFull(RuntimeError):
    """The stream stayed at its configured length for longer than the producer's timeout."""


class QueueUnavailable(RuntimeError):
    """The queue's server cannot be reached now (down, restarting, loading its data): retry the same call."""


@dataclass
class Delivery:
    entry_id: str
    trajectory: Trajectory
    delivery_count: int = 1


@dataclass
class QueueLag:
    length: int
    """Entries in the stream (acked ones are trimmed by the consumer side)."""
    pending: int
    """Delivered to the group, not acked."""
    undelivered: int
    """Not yet delivered to the group."""
    oldest_unacked_age_s: float
    """Age of the oldest entry that is pending or undelivered; 0 when none."""


class TrajectoryQueue(abc.ABC):
    stream: str
    dead_letter_stream: str
    transient_errors: tuple[type[BaseException], ...] = (ConnectionError, TimeoutError)
    """Exceptions that mean "the backend is unreachable for now": callers retry them with backoff."""

    async def put_many(self, trajectories: Iterable[Trajectory], timeout_s: float | None = None) -> list[str]:
        """Encode (validating) and append; waits while the stream is full. Returns entry ids."""
        return await self.put_encoded(encode_many(list(trajectories)), timeout_s)

    @abc.abstractmethod
    async def put_encoded(self, payloads: list[bytes], timeout_s: float | None = None) -> list[str]:
        """Append records that ``molt.schema.encode_many`` made (and so validated), in order; waits while the
        stream is full. Returns entry ids. For a producer that also needs the records' sizes."""

    @abc.abstractmethod
    async def put_once(
        self, payloads: list[bytes], record_ids: list[str], keep_s: float, timeout_s: float | None = None
    ) -> list[str]:
        """``put_encoded``, at most once per record id within ``keep_s``: a record whose id a call already put
        is not written again and its entry id comes back as "". For a producer that retries a write whose
        outcome it could not see (the connection dropped): it repeats the call until one returns."""

    async def put(self, trajectory: Trajectory, timeout_s: float | None = None) -> str:
        return (await self.put_many([trajectory], timeout_s))[0]

    @abc.abstractmethod
    async def read(self, consumer: str, count: int, block_s: float = 1.0) -> list[Delivery]:
        """Up to ``count`` new entries for ``consumer``; waits up to ``block_s`` when none."""

    @abc.abstractmethod
    async def read_pending(self, consumer: str, count: int) -> list[Delivery]:
        """Entries already delivered to ``consumer`` and not acked (after a restart)."""

    @abc.abstractmethod
    async def reclaim(self, consumer: str, min_idle_s: float, count: int) -> list[Delivery]:
        """Take over entries pending on *other* consumers for at least ``min_idle_s``."""

    @abc.abstractmethod
    async def ack(self, deliveries: Iterable[Delivery]) -> None:
        """Commit: ack the entries and record their trajectory ids as consumed, atomically."""

    @abc.abstractmethod
    async def consumed(self, trajectory_ids: Iterable[str]) -> list[bool]:
        """Whether each id was already committed by the group."""

    @abc.abstractmethod
    async def lag(self) -> QueueLag:
        """Current length / pending / undelivered / oldest-unacked age."""

    async def close(self) -> None:
        return None
