"""The Redis Streams bus against a real server: exactly-once through a crash, dead letter, lag, backpressure."""

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from molt.bus import QUEUE_METRICS, QueueFull
from molt.bus.redis_stream import RedisTrajectoryQueue
from molt.metrics import Metrics
from molt.schema import Segment, Trajectory

pytestmark = pytest.mark.redis
HERE = Path(__file__).resolve().parent


def traj(tid: str, tokens: int = 64) -> Trajectory:
    seg = Segment(
        token_ids=np.arange(tokens),
        action_spans=np.array([[tokens // 2, tokens]]),
        logprobs=np.full(tokens - tokens // 2, -0.5),
        versions=np.zeros(tokens - tokens // 2),
    )
    return Trajectory(trajectory_id=tid, group_id=f"g{tid[:4]}", sample_index=0, segments=[seg], reward=1.0)


@pytest.fixture(params=["server", "redis-6.2"])
def redis_url(request, redis_url):
    """Each test here runs on the suite's Redis and on Redis 6.2, the one a machine without Redis embeds."""
    return request.getfixturevalue("redis62_url") if request.param == "redis-6.2" else redis_url


@pytest.fixture
async def queue(redis_url, stream_name):
    q = RedisTrajectoryQueue(redis_url, stream_name, metrics=Metrics(QUEUE_METRICS), trim_every=500)
    yield q
    await q.delete()
    await q.close()


async def test_ten_thousand_exactly_once_through_a_killed_consumer(queue, redis_url, stream_name, tmp_path):
    ids = [f"{i:05d}" for i in range(10_000)]
    for start in range(0, len(ids), 500):
        await queue.put_many([traj(t) for t in ids[start : start + 500]])
    await queue.ensure_group()

    # Consumer A: a real process that acks 20 batches, reads a 21st and is SIGKILLed before acking it.
    log_a = tmp_path / "a.log"
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "bus_consumer_proc.py"), redis_url, stream_name, "a", str(log_a), "20"],
        env={**os.environ, "PYTHONPATH": str(HERE.parent.parent)},
    )
    try:
        deadline = time.monotonic() + 60
        while not Path(str(log_a) + ".midbatch").exists():
            assert proc.poll() is None, "consumer A died early"
            assert time.monotonic() < deadline, "consumer A never reached its last batch"
            await asyncio.sleep(0.05)
            # Consumer B works concurrently.
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert int(Path(str(log_a) + ".midbatch").read_text()) == 100

    # Consumer B takes everything else, then reclaims what A left pending.
    trained_b: list[str] = []
    while batch := await queue.read("b", 250, block_s=0.2):
        trained_b += [d.trajectory.trajectory_id for d in batch]
        await queue.ack(batch)
    lag = await queue.lag()
    assert lag.pending == 100 and lag.undelivered == 0
    held = await queue.read("b", 10, block_s=0)  # nothing new: B holds no entries of its own
    assert held == [] and await queue.reclaim("a", min_idle_s=0.0, count=1000) == []  # never one's own entries
    reclaimed = await queue.reclaim("b", min_idle_s=0.0, count=1000)
    assert len(reclaimed) == 100
    trained_b += [d.trajectory.trajectory_id for d in reclaimed]
    await queue.ack(reclaimed)

    trained = log_a.read_text().split() + trained_b
    assert len(trained) == 10_000
    assert sorted(trained) == ids  # none lost, none twice
    lag = await queue.lag()
    assert (lag.pending, lag.undelivered) == (0, 0)
    await queue.trim_acked()
    assert await queue.redis.xlen(stream_name) == 0


async def test_redelivery_of_committed_id_is_skipped(queue):
    await queue.put(traj("dup1"))
    got = await queue.read("c", 10, block_s=0.1)
    await queue.ack(got)
    await queue.put(traj("dup1"))  # e.g. a producer retried after a timeout
    assert await queue.read("c", 10, block_s=0.1) == []
    assert (await queue.lag()).pending == 0


async def test_the_exactly_once_filter_forgets_ids_after_its_window_so_its_memory_is_bounded(redis_url, stream_name):
    """Committed ids are remembered for --redis.consumed_keep_s (in time-bucketed sets that expire), not for good:
    Redis would otherwise grow by every trajectory a run ever trained. Within the window a repeat is skipped."""
    from molt.bus.redis_stream import CONSUMED_BUCKETS

    q = RedisTrajectoryQueue(redis_url, stream_name, consumed_keep_s=1.5)
    try:
        for i in range(3):
            await q.put(traj(f"w{i}"))
            await q.ack(await q.read("c", 10, block_s=0.1))
        await q.put(traj("w0"))
        assert await q.read("c", 10, block_s=0.1) == []  # a repeat inside the window
        keys = [k async for k in q.redis.scan_iter(match=q.consumed_prefix + "*")]
        assert 1 <= len(keys) <= CONSUMED_BUCKETS + 2
        ttls = [await q.redis.pttl(k) for k in keys]
        assert all(0 < ttl <= 1.5e3 * (1 + 1 / CONSUMED_BUCKETS) for ttl in ttls)
        await asyncio.sleep(1.8)
        assert [k async for k in q.redis.scan_iter(match=q.consumed_prefix + "*")] == []
        assert await q.consumed(["w0", "w1", "w2"]) == [False, False, False]
    finally:
        await q.delete()
        await q.close()


async def test_committed_and_in_batch_repeats_are_skipped(queue):
    await queue.put_many([traj("c1"), traj("c2"), traj("c3")])
    await queue.ack(await queue.read("c", 10, block_s=0.1))
    assert await queue.consumed(["c0", "c1", "x", "c3", "c2"]) == [False, True, False, True, True]
    await queue.put_many([traj("c2"), traj("n1"), traj("n1"), traj("c3"), traj("n2")])
    got = await queue.read("c", 10, block_s=0.1)
    assert [d.trajectory.trajectory_id for d in got] == ["n1", "n2"]
    assert (await queue.lag()).pending == 2  # the repeats were acked, not left pending


async def test_entry_of_another_schema_version_lands_in_dead_letter_with_the_reason(queue, stream_name):
    """A record this decoder cannot read is never trained on: it goes to the dead-letter stream, named."""
    import msgpack

    await queue.put(traj("good"))
    await queue.redis.xadd(stream_name, {"d": msgpack.packb({"schema": 1, "id": "old1"}), "id": "old1"})
    got = await queue.read("c", 10, block_s=0.1)
    assert [d.trajectory.trajectory_id for d in got] == ["good"]
    dead = await queue.redis.xrange(queue.dead_letter_stream)
    assert len(dead) == 1
    assert b"schema version 1" in b"".join(v for v in dead[0][1].values() if isinstance(v, bytes))


async def test_corrupt_entry_lands_in_dead_letter(queue, stream_name):
    await queue.put(traj("good"))
    await queue.redis.xadd(stream_name, {"d": b"\x93not-a-trajectory", "id": "bad"})
    got = await queue.read("c", 10, block_s=0.1)
    assert [d.trajectory.trajectory_id for d in got] == ["good"]
    dead = await queue.redis.xrange(queue.dead_letter_stream)
    assert len(dead) == 1
    fields = dead[0][1]
    assert fields[b"d"] == b"\x93not-a-trajectory" and b"record" in fields[b"error"]
    assert queue.metrics["molt_queue_dead_letter_total"].labels(stream_name)._value.get() == 1
    assert (await queue.lag()).pending == 1  # the good one, not the corrupt one


async def test_lag_gauges_match_redis(queue, stream_name):
    await queue.put_many([traj(f"l{i}") for i in range(30)])
    await queue.read("c", 12, block_s=0.1)
    await asyncio.sleep(0.05)
    lag = await queue.lag()
    summary = await queue.redis.xpending(stream_name, queue.group)
    assert lag.length == await queue.redis.xlen(stream_name) == 30
    assert lag.pending == summary["pending"] == 12
    assert lag.undelivered == 18
    assert lag.oldest_unacked_age_s >= 0.05
    text = Metrics.render(queue.metrics)[0].decode()
    assert f'molt_queue_length_entries{{stream="{stream_name}"}} 30.0' in text
    assert f'molt_queue_pending_entries{{stream="{stream_name}"}} 12.0' in text
    assert f'molt_queue_undelivered_entries{{stream="{stream_name}"}} 18.0' in text


async def test_backpressure_engages_at_max_len_and_never_trims(redis_url, stream_name):
    q = RedisTrajectoryQueue(redis_url, stream_name, max_len=50, trim_every=10)
    try:
        await q.ensure_group()
        await q.put_many([traj(f"b{i}") for i in range(50)])
        with pytest.raises(QueueFull, match="--redis.max_len 50"):
            await q.put(traj("over"), timeout_s=0.3)
        assert await q.redis.xlen(stream_name) == 50  # nothing trimmed, nothing half-written

        async def consume():
            await asyncio.sleep(0.2)
            await q.ack(await q.read("c", 10, block_s=0.1))  # ack 10 -> trim of acked entries

        task = asyncio.create_task(consume())
        await q.put(traj("over"), timeout_s=5)
        await task
        assert await q.redis.xlen(stream_name) == 41
    finally:
        await q.delete()
        await q.close()


async def test_lag_reaches_zero_once_everything_is_delivered(queue, request):
    """Redis 6.2 has no per-group lag and keeps acked entries in the stream, so the undelivered count must come
    from the group's last delivered id, or a trainer waiting for the end of its dataset never sees it."""
    if request.node.callspec.params["redis_url"] == "redis-6.2":
        assert (await queue.redis.info("server"))["redis_version"].startswith("6.2.")
    await queue.put_many([traj(f"{i:05d}") for i in range(5)])
    assert (await queue.lag()).undelivered == 5
    got = await queue.read("c", 3, block_s=0.1)
    await queue.ack(got)
    assert (await queue.lag()).undelivered == 2
    await queue.ack(await queue.read("c", 10, block_s=0.1))
    assert (await queue.lag()).undelivered == 0  # length - pending would still say 5
